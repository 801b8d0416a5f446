"""Multi-region KServe v2 / Triton gateway: HTTP + gRPC front, routing, balancing, cache, auth, metrics."""

from gateway import compiled_build

# Before any other gateway module is imported: which build (compiled or pure Python) this process runs.
compiled_build.install()
