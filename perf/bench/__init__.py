"""`baton bench`: a workload driven through a public front door of a running cluster (driver,
clients, workloads, arrivals), its per-request timeline and the report, table and plots."""
