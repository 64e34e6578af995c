"""`baton deploy apply | scale | status | down`: reconcile a running Ray cluster to a manifest.

Every command connects to Ray at --address (default: $RAY_ADDRESS, else "auto": the cluster
`ray start` left on this machine, see deploy/ray_address.py) and talks only to the controller
actor, through a deploy/client.py DeployClient; the controller does the work and outlives the
command. A
cluster that cannot be reached is reported within seconds, in one line. Exit codes: 0 done,
1 failed (e.g. no cluster), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from deploy.client import ControllerClient, DeployClient, NoController, Unreachable
from deploy.manifest import MIN_REPLICAS, ManifestError, check_resources, load_manifest
from kvtransfer.worker_api import Role

WAIT_S = 1800.0  # the longest apply: worker start-up plus drains
STATUS_S = 120.0  # the controller gathers every worker's stats
SHUTDOWN_S = 300.0  # `down`: the controller stops the router and removes every worker
GONE_S = 60.0  # `down`: Ray takes the killed actors out of its registry


def parser() -> argparse.ArgumentParser:
    """`baton deploy` and its commands; each sets `run`, its handler: run(args, client) -> exit
    code."""
    deploy = argparse.ArgumentParser(prog="baton deploy", description=__doc__.split("\n")[0])
    commands = deploy.add_subparsers(dest="deploy_command", required=True)
    apply = commands.add_parser("apply", help="reconcile the cluster to a manifest (idempotent)")
    apply.add_argument("-f", "--file", required=True, help="the Baton manifest (YAML)")
    apply.set_defaults(run=_apply)
    scale = commands.add_parser("scale", help="change pool sizes: prefill=N decode=M")
    scale.add_argument(
        "pools", nargs="+", metavar="POOL=N", help="prefill=N and/or decode=M (N >= 1)"
    )
    scale.set_defaults(run=_scale)
    status = commands.add_parser("status", help="workers, health, load, KV usage, hit rate")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(run=_status)
    down = commands.add_parser("down", help="remove every Baton actor and free its resources")
    down.set_defaults(run=_down)
    for p in (apply, scale, status, down):
        p.add_argument(
            "--address",
            default=None,
            help="Ray cluster address HOST:PORT (default: $RAY_ADDRESS, else auto: the cluster "
            "`ray start --head` recorded in $RAY_TMPDIR/ray/ray_current_cluster, "
            "$RAY_TMPDIR being $TMPDIR or /tmp if unset)",
        )
    return deploy


def _connect(client: DeployClient, address: str | None) -> None:
    """Connect to the Ray cluster, or exit 1 at once with one line saying why not."""
    try:
        client.connect(address)
    except Unreachable as exc:
        raise SystemExit(_fail(str(exc), 1)) from None


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _cause(exc: BaseException) -> BaseException:
    """The exception an actor raised, out of Ray's wrapper."""
    return getattr(exc, "cause", None) or exc


def _reconcile(controller: ControllerClient, method: str, arg: dict) -> int:
    """Run an apply or scale on the controller, show its progress and the outcome."""
    start = time.monotonic()

    def show(line: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {line}", flush=True)

    try:
        result = controller.follow(method, arg, on_event=show, limit_s=WAIT_S)
    except KeyboardInterrupt:
        print(
            "\ninterrupted: the controller finishes this reconcile on its own; "
            "`baton deploy status` shows it",
            file=sys.stderr,
        )
        return 1
    except Exception as exc:  # noqa: BLE001 - shown as one line, never a traceback
        cause = _cause(exc)
        return _fail(str(cause), 2 if isinstance(cause, ManifestError | ValueError) else 1)
    what = "; ".join(result["changes"]) if result["changed"] else "no change"
    print(f"generation {result['generation']}: {what}")
    return 0


def _apply(args: argparse.Namespace, client: DeployClient) -> int:
    try:
        manifest = load_manifest(args.file)
    except ManifestError as exc:
        return _fail(f"{args.file}:\n{exc}", 2)
    _connect(client, args.address)
    try:
        check_resources(manifest, *client.resources())
    except ManifestError as exc:
        return _fail(f"{args.file}:\n{exc}", 2)
    controller = client.controller(create=True)
    return _reconcile(controller, "apply", manifest.model_dump(mode="json"))


def parse_pools(pools: list[str]) -> dict[str, int]:
    """["prefill=2", "decode=3"] -> {"prefill": 2, "decode": 3}; ValueError on bad input."""
    out = {}
    for item in pools:
        role, sep, count = item.partition("=")
        if not sep or role not in tuple(Role):
            raise ValueError(f"{item!r}: expected prefill=N or decode=N")
        least = MIN_REPLICAS[role]  # prefill=0: aggregated
        if not count.isdigit() or int(count) < least:
            raise ValueError(f"{item!r}: N must be an integer >= {least}")
        out[role] = int(count)
    return out


def _scale(args: argparse.Namespace, client: DeployClient) -> int:
    try:
        replicas = parse_pools(args.pools)
    except ValueError as exc:
        return _fail(str(exc), 2)
    _connect(client, args.address)
    try:
        controller = client.controller()
    except NoController as exc:
        return _fail(str(exc), 1)
    return _reconcile(controller, "scale", replicas)


def _status(args: argparse.Namespace, client: DeployClient) -> int:
    _connect(client, args.address)
    try:
        status = client.controller().call("status", timeout=STATUS_S)
    except NoController as exc:
        return _fail(str(exc), 1)
    except Exception as exc:  # noqa: BLE001 - a dead or hung controller: one line
        return _fail(f"the controller does not answer: {client.short_error(exc)}", 1)
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    print(format_status(status))
    return 0


def format_status(status: dict) -> str:
    """The human-readable table of `baton deploy status`."""
    router = status.get("router") or {}
    replicas = status["replicas"]
    lines = [
        f"cluster {status['name']}  generation {status['generation']}  "
        f"prefill {replicas['prefill']}  decode {replicas['decode']}  "
        f"{status.get('mode', '-')}",
        f"router grpc {router.get('address', '-')}  http {router.get('http_address') or '-'}  "
        f"policy {router.get('policy', '-')}  "
        f"hit rate {router.get('hit_rate', 0.0):.2f}",
        serving_line(status.get("router")),
        "",
        f"{'WORKER':<12}{'ROLE':<9}{'STATE':<10}{'HEALTHY':<9}{'REQUESTS':>9}"
        f"{'KV USAGE':>10}{'HIT RATE':>10}"
        + ("  NODE" if any(w.get("node_id") for w in status["workers"]) else ""),
    ]
    for w in sorted(status["workers"], key=lambda w: (w["role"] != Role.PREFILL, w["worker_id"])):
        lines.append(
            f"{w['worker_id']:<12}{w['role']:<9}{w['state']:<10}"
            f"{'yes' if w['healthy'] else 'NO':<9}{w.get('num_requests', 0):>9}"
            f"{w.get('kv_usage', 0.0):>10.1%}{w.get('cache_hit_rate', 0.0):>10.2f}"
            + (f"  {w['node_id'][:8]}" if w.get("node_id") else "")
        )
    lines += _health_lines(status)
    return "\n".join(lines)


def serving_line(router: dict | None) -> str:
    """Whether the cluster can serve a new request, as the router's /health answers it
    (router/readiness.py: its `readiness` in the router's stats), and the healthy pools."""
    ready = (router or {}).get("readiness")
    if ready is None:
        why = (router or {}).get("error") or "no router runs"
        return f"serving NO: {why}"
    verdict = "yes" if ready["serving"] else f"NO: {ready['status']}"
    pools = "  ".join(
        f"{role} {pool['healthy']}/{pool['workers']}" for role, pool in ready["pools"].items()
    )
    return f"serving {verdict}  mode {ready['mode']}  healthy {pools}"


def _health_lines(status: dict) -> list[str]:
    """Below the table: a degraded pool (running < wanted), the live nodes, the last
    progress lines (a lost worker, a restart, a re-adoption)."""
    lines = []
    if status.get("degraded"):
        short = [
            f"{role} {status['running'][role]} of {status['wanted'][role]} running"
            for role in status["wanted"]
            if status["running"][role] < status["wanted"][role]
        ]
        lines += ["", f"DEGRADED: {', '.join(short)} (workers wait for resources or a restart)"]
    if status.get("nodes"):
        lines += ["", f"{len(status['nodes'])} live node(s):"]
        for n in status["nodes"]:
            custom = {k: v for k, v in n["resources"].items() if not k.startswith("node:")}
            lines.append(f"  {n['node_id'][:8]}  {n.get('address') or '-'}  {custom}")
    if status.get("events"):
        lines += ["", "recent events:", *(f"  {e}" for e in status["events"])]
    return lines


def _down(args: argparse.Namespace, client: DeployClient) -> int:
    _connect(client, args.address)
    try:
        controller = client.controller()
    except NoController:
        print("no Baton cluster runs here; nothing to remove")
        return 0

    print("removing the router and every worker ...", flush=True)
    try:
        controller.call("shutdown", timeout=SHUTDOWN_S)
    except Exception as exc:  # noqa: BLE001 - what it left is removed by name below
        print(
            f"the controller did not finish in time ({client.short_error(exc)}); killing it "
            "and removing every Baton actor and placement group by name",
            file=sys.stderr,
        )
    finally:
        controller.kill()
    # The workers, their placement groups and the router are detached (they outlive a dead
    # controller): whatever a failed shutdown left goes now.
    client.remove_leftovers()
    deadline = time.monotonic() + GONE_S
    while (left := client.baton_actors()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        return _fail(f"still running in Baton's namespace: {left}", 1)
    print("removed: router, workers, controller and their placement groups")
    return 0
