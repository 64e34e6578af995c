"""deploy: the manifest schema (manifest.py), example and KubeRay manifests, the Grafana
dashboard, and the `baton deploy apply | scale | status | down` commands (commands.py) with the
client that reaches a cluster's controller (client.py). Imports nothing of `cluster`: the
controller is handed in (cluster/deploy_command.py)."""
