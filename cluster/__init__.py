"""cluster: see ARCHITECTURE.md; not built yet."""
