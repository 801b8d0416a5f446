"""Watching the gateway run: metrics and their merging across workers, step costs, logs."""
