"""`baton deploy ...`: deploy/commands.py's commands, with the controller (cluster.controller) as
their ControllerSide and one-line errors. `deploy` never imports `cluster`; this module hands it
what it needs."""

from __future__ import annotations

from typing import Any

from cluster.cli import run_one_line
from deploy import commands
from deploy.client import ControllerSide, DeployClient, NoController


class ControllerModule:
    """deploy.client.ControllerSide on cluster.controller (imported on construction: ray and
    torch, about 1.5 s, paid only once a command has found a live Ray cluster)."""

    def __init__(self) -> None:
        from cluster import controller

        self._controller = controller
        self.namespace = controller.NAMESPACE

    def controller_handle(self, create: bool) -> Any:
        try:
            return self._controller.controller_handle(create=create)
        except self._controller.NoCluster as exc:
            raise NoController(str(exc)) from None

    def node_resources(self) -> list[dict[str, float]]:
        return self._controller.node_resources()

    def remove_everything(self) -> list[str]:
        return self._controller.remove_everything()

    def short_error(self, exc: BaseException) -> str:
        return self._controller.short_error(exc)


def controller_side() -> ControllerSide:
    """The cluster layer's part of a deploy command."""
    return ControllerModule()


def deploy_client() -> DeployClient:
    """A DeployClient that reaches this package's controller."""
    return DeployClient(controller_side)


def main(argv: list[str]) -> int:
    """`baton deploy ARGV`."""
    args = commands.parser().parse_args(argv)
    return run_one_line(lambda: args.run(args, deploy_client()))
