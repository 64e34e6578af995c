"""`baton profile serving`: where a serving step's time goes (engine phases, threads, the
token path), and its report."""
