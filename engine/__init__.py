"""Baton engine: one process serving a Llama-family model with paged KV."""
