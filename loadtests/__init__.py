"""Locust load tests for the gateway (HTTP JSON, HTTP binary, gRPC) with skewed traffic."""
