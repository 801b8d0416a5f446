# syntax=docker/dockerfile:1
# The skewserve gateway image: the `gateway` extra only (no torch, ONNX, training or locust).
# Build from the repository root (the build context must be the root; BuildKit reads the
# ignore list beside this file, deploy/gateway.Dockerfile.dockerignore):
#   docker build -f deploy/gateway.Dockerfile -t skewserve/gateway:0.1.0 .
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY skewserve ./skewserve
COPY gateway ./gateway
# The controller (`skewserve controller`) runs from this image too; it reads model cards and configs
# through repository/ and exporter/'s light modules only (no torch, no ONNX; tests/deploy checks the list).
COPY controller ./controller
COPY repository ./repository
COPY exporter/__init__.py exporter/contract.py exporter/errors.py exporter/plans.py exporter/target.py exporter/triton_config.py ./exporter/
COPY training/__init__.py training/data_spec.py ./training/
# --prefix: everything the gateway needs lands in /install, copied alone into the runtime stage.
COPY deploy/gateway.constraints.txt ./
RUN pip install --no-cache-dir --prefix=/install --constraint gateway.constraints.txt ".[gateway,s3]"

FROM python:3.11.11-slim-bookworm
RUN useradd --create-home --uid 10001 skewserve
COPY --from=build /install /usr/local
USER 10001
EXPOSE 8080 8081 8082
HEALTHCHECK --interval=10s --timeout=2s CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/v2/health/live', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["skewserve", "gateway", "--config", "/etc/skewserve/gateway.yaml"]
