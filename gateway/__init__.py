"""Multi-region KServe v2 / Triton gateway: HTTP + gRPC front, routing, balancing, cache, auth, metrics."""
