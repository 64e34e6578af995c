"""prefill_worker: an engine in the prefill role (see worker.py)."""
