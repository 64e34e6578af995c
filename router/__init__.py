"""router: see ARCHITECTURE.md; not built yet."""
