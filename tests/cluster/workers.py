"""Worker records for the controller's pure tests: the templates of a tiny manifest, and
Worker records whose actor handle and placement group are plain strings (no Ray)."""

from __future__ import annotations

from cluster.templates import WorkerTemplate, worker_templates
from cluster.worker_actor import Worker
from deploy.manifest import parse_manifest
from tests.cluster.manifests import tiny_manifest

TEMPLATES = worker_templates(parse_manifest(tiny_manifest("tiny")))


def worker(worker_id: str, template: WorkerTemplate | None = None, **fields) -> Worker:
    """A record of `worker_id` (its role is the id's prefix), handle "h:<id>", group "pg:<id>"."""
    role = worker_id.split("-")[0]
    return Worker(
        worker_id, template or TEMPLATES[role], f"h:{worker_id}", f"pg:{worker_id}", **fields
    )
