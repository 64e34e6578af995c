"""decode_worker: an engine in the decode role (see worker.py)."""
