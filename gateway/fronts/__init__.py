"""The wire in and out: HTTP (protocol-level infer, FastAPI for the rest), gRPC (HAProxy bridge or
grpc.aio), streams and generate; each front turns its wire into a pipeline call and back."""
