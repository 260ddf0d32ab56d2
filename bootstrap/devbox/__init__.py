"""The dev box's own side: its idle watcher (stop the bill when nobody uses it) and what it reports."""
