"""prefill_worker: see ARCHITECTURE.md; not built yet."""
