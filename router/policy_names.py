"""The names of the prefill routing policies, torch-free: router.policy registers one class
under each name, and the manifest's `spec.router.policy` accepts exactly these."""

from typing import Literal, get_args

PolicyName = Literal["cache_aware", "round_robin", "least_loaded", "random"]
POLICY_NAMES: tuple[PolicyName, ...] = get_args(PolicyName)
DEFAULT_POLICY: PolicyName = "cache_aware"
POLICY_DESCRIPTION = (
    "prefill worker choice: cache_aware (longest cached prefix, minus load), round_robin, "
    "least_loaded or random"
)
