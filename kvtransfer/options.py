"""TransferOptions: the one definition of how a worker moves KV (name, type, default,
description, bounds), torch-free so that the manifest's `spec.transfer` derives from it.
No `from __future__ import annotations` here: a field's `type` must be the type itself."""

from dataclasses import dataclass

from engine.options import check_options, option

BACKEND_NAMES = ("gloo", "nccl")  # the keys of kvtransfer.backends.BACKENDS


class TransferOptionsError(ValueError):
    """A transfer option out of its allowed range."""


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """How a worker moves KV: backend, lease on held/reserved blocks, per-step timeout."""

    backend: str = option(
        "auto",
        "pair group backend (auto: nccl when the KV cache is on CUDA, gloo otherwise)",
        choices=("auto", *BACKEND_NAMES),
    )
    lease_seconds: float = option(30.0, "lease on reserved and held blocks", gt=0)
    timeout_seconds: float = option(10.0, "bound on every transfer wait", gt=0)
    advertise_host: str = option(
        "auto",
        "address the worker's peers reach its pair stores and gloo sockets at "
        "(auto: the node's IP under Ray, else 127.0.0.1)",
        min_length=1,
    )

    def __post_init__(self) -> None:
        check_options(self, TransferOptionsError)
