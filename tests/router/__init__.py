"""Router routing core: the KV index and the worker-choice policies."""
