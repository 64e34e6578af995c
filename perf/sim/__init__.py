"""`baton simulate` / `baton plan`: the cluster as a discrete-event simulation.

Reuses the pure pieces (router/policy.py, router/kv_index.py, engine/block_pool.py,
engine/block_hash.py, engine/chunk_budget.py, engine/step_model.py, perf/bench/workloads.py)
and replaces only time: model steps by a step profile, KV transfers by bytes over bandwidth.
"""
