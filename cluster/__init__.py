"""cluster: Baton on Ray. The controller actor (controller.py) composes one module per job:
its saved state (state.py), reconcile (reconcile.py, executing plan.py's steps), placement,
pairing, drain, router lifecycle, health and repair, recovery after a restart, status; worker
and router actors (worker_actor.py, router_actor.py); `baton serve` (cli.py, local.py) and
`baton deploy` (deploy_command.py)."""
