"""What a reconcile will do, decided without doing it: plan(current, desired, free) -> Plan.

Pure (no Ray, no clock): the controller snapshots its active workers, the manifest's pools and
Ray's free resources, asks plan() for the steps, and executes them in order. Per pool, a
running worker whose template key equals the manifest's is kept (the oldest first); the rest
are outdated. Workers are started to reach the replicas and outdated and surplus workers
leave; a prefill pool of 0 replicas (aggregated) keeps none and pairs nothing. Three ways to
place the new workers:

- SURGE: the free resources hold every new worker beside the old ones (or no router runs yet,
  a first apply): start them, pair them, then retire the leaving workers. No pool is ever empty.
- ROLLING: no room beside the old ones and the KV format stays: surplus and extra outdated
  workers leave first; then, per pool, one outdated worker is drained and removed and its
  successor started (and paired and published) before the next one.
- ALL_AT_ONCE: no room and the KV format changes (a new worker could not exchange KV with an
  old one): every leaving worker is retired, then all new workers start. Requests wait at the
  router meanwhile (spec.router.wait_for_workers_seconds).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from cluster.templates import ROLES, WorkerTemplate


@dataclass(frozen=True, slots=True)
class Running:
    """An active (not draining) worker as the plan sees it."""

    worker_id: str
    template: WorkerTemplate


@dataclass(frozen=True, slots=True)
class Current:
    """The cluster before the reconcile."""

    workers: tuple[Running, ...]  # active workers, in start order (oldest first)
    has_router: bool


@dataclass(frozen=True, slots=True)
class Pool:
    """What the manifest wants of one role."""

    template: WorkerTemplate
    replicas: int


# ---- steps: the controller executes them in order ----------------------------------------
@dataclass(frozen=True, slots=True)
class Start:
    """Place and start `count` workers of the role's desired template; they answer when done."""

    role: str
    count: int


@dataclass(frozen=True, slots=True)
class Pair:
    """Pair every active prefill worker with every active decode worker of its KV key."""


@dataclass(frozen=True, slots=True)
class EnsureRouter:
    """Start the router, restart it when its server options changed, else reconfigure it."""


@dataclass(frozen=True, slots=True)
class Retire:
    """Stop routing to these workers (publishing the rest), drain them, then remove them."""

    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Publish:
    """Tell the router which workers take new requests (the active ones)."""


@dataclass(frozen=True, slots=True)
class Note:
    """A progress line explaining the strategy."""

    text: str


Step = Start | Pair | EnsureRouter | Retire | Publish | Note


class Strategy(enum.Enum):
    SURGE = "surge"
    ROLLING = "rolling"
    ALL_AT_ONCE = "all at once"


@dataclass(frozen=True, slots=True)
class Plan:
    """The steps of one reconcile and the changes they make, as `apply` reports them."""

    strategy: Strategy
    steps: tuple[Step, ...]
    changes: tuple[str, ...]  # e.g. "replace 1 prefill worker(s) (options changed)"


def plan(current: Current, desired: Mapping[str, Pool], free: Mapping[str, float]) -> Plan:
    """The steps that bring `current` to `desired` given Ray's free resources (e.g.
    ray.available_resources()). Every role in ROLES must be in `desired`."""
    changes: list[str] = []
    start: dict[str, int] = {}
    outdated: dict[str, list[str]] = {}
    surplus: dict[str, list[str]] = {}
    kv_change = False
    for role in ROLES:
        want = desired[role].template
        active = [w for w in current.workers if w.template.role == role]
        keep = [w.worker_id for w in active if w.template.key == want.key]
        old = [w for w in active if w.template.key != want.key]
        kv_change = kv_change or any(w.template.kv_key != want.kv_key for w in old)
        outdated[role] = [w.worker_id for w in old]
        surplus[role] = keep[desired[role].replicas :]  # the newest go first
        start[role] = max(0, desired[role].replicas - len(keep))
        replaced = min(start[role], len(outdated[role]))
        removed = len(outdated[role]) + len(surplus[role]) - replaced
        for count, verb in ((replaced, "replace"), (start[role] - replaced, "add")):
            if count:
                suffix = " (options changed)" if verb == "replace" else ""
                changes.append(f"{verb} {count} {role} worker(s){suffix}")
        if removed:
            changes.append(f"remove {removed} {role} worker(s)")

    need: dict[str, float] = {}
    for role in ROLES:
        for name, amount in desired[role].template.resources.items():
            need[name] = need.get(name, 0.0) + amount * start[role]
    room = all(free.get(name, 0.0) >= amount for name, amount in need.items())
    leaving = tuple(w for role in ROLES for w in outdated[role] + surplus[role])
    steps: list[Step]
    if room or not current.has_router:
        strategy = Strategy.SURGE
        steps = [Start(role, start[role]) for role in ROLES if start[role]]
        steps += [Pair(), EnsureRouter(), _retire(leaving)]  # publishes the new workers
    elif kv_change:
        strategy = Strategy.ALL_AT_ONCE
        steps = [
            EnsureRouter(),
            Note(
                f"not enough free resources ({dict(free)}) to start the new workers beside "
                "the old ones, and the KV format changes: replacing every worker at once; "
                "requests wait at the router meanwhile"
            ),
            _retire(leaving),
        ]
        steps += [Start(role, start[role]) for role in ROLES if start[role]]
        steps += [Pair(), Publish()]
    else:
        strategy = Strategy.ROLLING
        replace = {role: outdated[role][: start[role]] for role in ROLES}
        if any(replace.values()):
            how = "replacing one worker at a time"
        else:  # nothing leaves to make room: the new workers wait for their bundles
            how = f"starting them anyway (they need {need}), each waiting for room"
        steps = [
            EnsureRouter(),
            Note(
                f"not enough free resources ({dict(free)}) to start the new workers beside "
                f"the old ones: {how}"
            ),
            _retire(
                tuple(w for role in ROLES for w in outdated[role][start[role] :] + surplus[role])
            ),
        ]
        for role in ROLES:
            for worker_id in replace[role]:
                steps += [Retire((worker_id,)), Start(role, 1), Pair(), Publish()]
            if start[role] > len(replace[role]):
                steps.append(Start(role, start[role] - len(replace[role])))
        steps += [Pair(), Publish()]
    return Plan(strategy, tuple(steps), tuple(changes))


def _retire(worker_ids: tuple[str, ...]) -> Retire | Publish:
    """Retiring no worker is publishing the active ones."""
    return Retire(worker_ids) if worker_ids else Publish()
