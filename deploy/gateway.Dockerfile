# The skewserve gateway image (CPU only; it never touches tensors).
# Build from the repository root: docker build -f deploy/gateway.Dockerfile -t skewserve/gateway .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY skewserve ./skewserve
COPY training ./training
COPY exporter ./exporter
COPY gateway ./gateway
COPY loadtests ./loadtests
# torch CPU wheel first so the project's range does not pull a CUDA build into a proxy image.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch>=2.4,<2.15" \
 && pip install --no-cache-dir .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 skewserve
COPY --from=build /usr/local /usr/local
USER skewserve
EXPOSE 8080 8081 8082
HEALTHCHECK --interval=10s --timeout=2s CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/v2/health/live',timeout=2).status==200 else 1)"
ENTRYPOINT ["skewserve", "gateway", "--config", "/etc/skewserve/gateway.yaml"]
