"""RouterSettings: what the router actor runs with.

Built from a manifest in one place (cluster/templates.py: router_settings), handed by the
controller to the router actor (cluster/router_actor.py) when it starts it and at every
apply. Fields in SERVER_FIELDS are what the front doors were started with: a change restarts
the router actor. The others change in place (Router.configure).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from router.policy_names import DEFAULT_POLICY


@dataclass(frozen=True, slots=True)
class TLSPaths:
    """PEM files on the router's host (router.security.TLSFiles checks there that they exist)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None  # set: clients must present a certificate it signed


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The router actor's settings; defaults are the manifest's (deploy/manifest.py)."""

    # ---- the front doors (SERVER_FIELDS: a change restarts the router actor) -----------
    model: str = ""  # spec.model.path: its tokenizer turns text prompts into token ids
    skip_tokenizer: bool = False  # token-id prompts only (spec.model.skip_tokenizer_init)
    host: str = "127.0.0.1"  # both doors listen here
    port: int = 50051  # gRPC (0: any free port)
    http_port: int | None = 8000  # OpenAI-compatible HTTP (0: any free port; None: no door)
    served_model_names: tuple[str, ...] = ()  # the names clients send; the first is shown
    api_key_env: str | None = None  # environment variable holding the API keys
    api_key_file: str | None = None  # file holding the API keys, one per line
    tls: TLSPaths | None = None  # TLS for both doors (None: plain)
    max_pending_requests: int | None = None  # admission bound (None: no bound)
    chat_template: str | None = None  # a Jinja file replacing the tokenizer's chat template
    # ---- routing (Router.configure changes these in place) -----------------------------
    policy: str = DEFAULT_POLICY  # the prefill policy's name (router/policy_names.py)
    local_prefill_tokens: int = 0  # uncached tail prefilled on the decode worker (0: never)
    aggregated: bool = False  # 0 prefill workers: every request prefills on its decode worker
    wait_for_workers_s: float = 120.0  # a request's wait for a healthy worker and free KV
    migration_limit: int = 3  # moves of a request whose worker failed
    # ---- the pools' (the manifest guarantees both pools hash blocks alike) -------------
    block_size: int = 16
    hash_seed: str = "baton"
    health_period_s: float = 2.0  # how often the router asks the controller for health

    def server_key(self) -> tuple:
        """The SERVER_FIELDS' values, plain JSON values (the controller saves the key and
        compares it again after a restart): equal keys need no router restart."""
        return tuple(_plain(getattr(self, name)) for name in SERVER_FIELDS)


# What the router's front doors were started with.
SERVER_FIELDS = (
    "model",
    "skip_tokenizer",
    "host",
    "port",
    "http_port",
    "served_model_names",
    "api_key_env",
    "api_key_file",
    "tls",
    "max_pending_requests",
    "chat_template",
)


def _plain(value):
    """A value as JSON gives it back: tuples as lists, TLSPaths as a dict."""
    if isinstance(value, TLSPaths):
        return asdict(value)
    if isinstance(value, tuple):
        return list(value)
    return value
