"""deploy: see ARCHITECTURE.md; not built yet."""
