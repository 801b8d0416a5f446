"""Running the gateway: metrics, Triton statistics merging, the ops listener, the worker supervisor, logs."""
