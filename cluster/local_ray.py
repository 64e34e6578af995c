"""Start a new single-node Ray cluster in this process, tolerating a slow start.

Ray waits a fixed 30 s for the new raylet to register with the GCS and then raises. On a loaded
machine (a small CI runner, or right after another cluster's workers were killed and are still
exiting) that wait is sometimes too short; a second attempt after a clean shutdown succeeds.
"""

from __future__ import annotations

import os
import time

STARTUP_ATTEMPTS = 3


def start_local_ray(num_cpus: int, namespace: str, attempts: int = STARTUP_ATTEMPTS) -> None:
    """`ray.init` a fresh local cluster (never one named by RAY_ADDRESS) with `num_cpus`
    logical CPUs; retries only Ray's own startup timeout, any other error is raised at once."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for attempt in range(1, attempts + 1):
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                namespace=namespace,
                log_to_driver=False,
                configure_logging=False,
            )
            return
        except Exception as err:  # Ray raises a bare Exception for this timeout
            if "timed out during startup" not in str(err) or attempt == attempts:
                raise
            ray.shutdown()  # stops the half-started GCS and raylet before the next try
            time.sleep(2.0 * attempt)
