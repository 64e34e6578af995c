"""Whether the cluster can serve a new request now: the one decision behind every health answer.

HTTP GET /health, the gRPC health service (router/grpc_health.py) and `baton deploy status`
(the router actor's stats) all report `readiness(...)` of the router's pools. The shape that
counts is the router's mode in effect (router/pools.py):

  aggregated       a healthy decode worker is enough: it prefills every request itself
  disaggregated    a request needs a healthy prefill worker and a healthy decode worker

During a shape change the mode in effect follows what can serve: scaling the prefill pool to
0 turns aggregated mode on before its workers leave, and scaling it up again leaves aggregated
mode only once prefill workers are published, so a healthy decode worker keeps the cluster
serving throughout. A worker is healthy unless the controller's last health report or a
request it failed said otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

AGGREGATED = "aggregated"
DISAGGREGATED = "disaggregated"


@dataclass(frozen=True, slots=True)
class PoolHealth:
    """One pool as the router sees it."""

    healthy: int  # workers the router may send new requests to
    workers: int  # every worker of the pool (healthy or not)


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether a new request can be served now, in which shape, and which pools are healthy."""

    serving: bool
    mode: str  # AGGREGATED or DISAGGREGATED: the router's mode in effect
    prefill: PoolHealth
    decode: PoolHealth
    reason: str  # "ok", or which pool the shape needs has no healthy worker

    def body(self) -> dict:
        """The JSON body of /health and the `readiness` of the router's stats."""
        return {
            "status": self.reason,
            "serving": self.serving,
            "mode": self.mode,
            "pools": {
                "prefill": {"healthy": self.prefill.healthy, "workers": self.prefill.workers},
                "decode": {"healthy": self.decode.healthy, "workers": self.decode.workers},
            },
        }


def readiness(aggregated: bool, prefill: PoolHealth, decode: PoolHealth) -> Readiness:
    """Serving iff every pool the shape needs has a healthy worker (aggregated: the decode
    pool; disaggregated: both)."""
    needed = {"decode": decode} if aggregated else {"prefill": prefill, "decode": decode}
    missing = [role for role, pool in needed.items() if pool.healthy == 0]
    reason = f"no healthy {' or '.join(missing)} worker" if missing else "ok"
    mode = AGGREGATED if aggregated else DISAGGREGATED
    return Readiness(not missing, mode, prefill, decode, reason)
