"""kvtransfer: see ARCHITECTURE.md; not built yet."""
