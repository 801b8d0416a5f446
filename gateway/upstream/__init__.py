"""Transports to the Triton servers: pooled HTTP/1.1, gRPC (through the HAProxy relay or grpc.aio),
streams; one `UpstreamServer` per server holds them with its health and latency state."""
