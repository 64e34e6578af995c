"""cluster: Ray controller, worker actors and placement (see controller.py)."""
