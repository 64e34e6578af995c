"""Every wait of the controller, in seconds, named in one place.

A call that passes its timeout raises (Ray's GetTimeoutError), except where a comment says
what happens instead.
"""

from __future__ import annotations

# ---- starting and pairing workers ----------------------------------------------------------
PLACEMENT_S = 120.0  # a worker's bundle must be placeable within this, else the start fails
WORKER_START_S = 600.0  # new workers answer their first ping (model loading included)
PAIR_S = 60.0  # each side of setting up a prefill/decode pair's 2-rank group
UNPAIR_S = 30.0  # each side of tearing a pair down (a dead peer is logged and skipped)
WORKER_INFO_S = 60.0  # a decode worker reports its max_model_len

# ---- the router -------------------------------------------------------------------------------
ROUTER_START_S = 300.0  # the router loads its tokenizer and binds its gRPC port
ROUTER_CONFIGURE_S = 30.0  # a policy change in place; on timeout the router is restarted
PUBLISH_S = 60.0  # set_workers returns once no new request goes to a leaving worker
ROUTER_STOP_S = 30.0  # open streams get 5 s of it; the actor is killed afterwards either way

# ---- draining and removing --------------------------------------------------------------------
DRAIN_QUERY_S = 30.0  # router.active_counts, and a leaving worker's stats (dead: skipped)
DRAIN_POLL_S = 0.5  # between two looks at a draining worker's requests
DRAIN_REPORT_S = 2.0  # at most one "waiting for ..." progress line per this
WORKER_SHUTDOWN_S = 20.0  # a removed worker's own shutdown; it is killed afterwards either way

# ---- queries ----------------------------------------------------------------------------------
HEALTH_PING_S = 10.0  # check_health: a worker that does not answer is unhealthy
STATS_S = 10.0  # status and workers: a worker or router that does not answer shows the error
