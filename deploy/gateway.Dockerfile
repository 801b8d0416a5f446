# syntax=docker/dockerfile:1
# The skewserve gateway image: the `gateway` extra only (no torch, ONNX, training or locust).
# Build from the repository root (the build context must be the root; BuildKit reads the
# ignore list beside this file, deploy/gateway.Dockerfile.dockerignore):
#   docker build -f deploy/gateway.Dockerfile -t skewserve/gateway:0.1.0 .
# The full image for the build: gcc and Python's headers compile the gateway's hot path (mypyc); the
# runtime stage is the slim image of the same Python and Debian release, so the extensions load there.
FROM python:3.11.11-bookworm AS build
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
COPY deploy/gateway.constraints.txt ./
# The compiled build, made in place as `make setup` makes it (docs/gateway.md#compiled-build): mypyc
# from the lock's mypy, type-checking against the gateway's own pinned dependencies in a venv of
# its own (so the install below still puts every dependency in /install); the wheel carries the
# extension modules and gateway/compiled.json, and a gateway source that differs from its recorded
# hash sets the whole build aside at start-up.
COPY scripts/compile_gateway.py ./scripts/
RUN python -m venv /compile \
 && /compile/bin/pip install --no-cache-dir --constraint gateway.constraints.txt ".[gateway,s3]" \
      "mypy==2.4.1" "mypy-extensions==1.2.0" "ast-serialize==0.13.1" "librt==0.17.0" "pathspec==1.1.1" \
      "setuptools==84.2.1" "wheel==0.48.0" \
 && PYTHONPATH=/src /compile/bin/python scripts/compile_gateway.py
# --prefix: everything the gateway needs lands in /install, copied alone into the runtime stage.
RUN pip install --no-cache-dir --prefix=/install --constraint gateway.constraints.txt ".[gateway,s3]"

FROM python:3.11.11-slim-bookworm
RUN useradd --create-home --uid 10001 skewserve
COPY --from=build /install /usr/local
USER 10001
EXPOSE 8080 8081 8082
HEALTHCHECK --interval=10s --timeout=2s CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/v2/health/live', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["skewserve", "gateway", "--config", "/etc/skewserve/gateway.yaml"]
