# Triton GPU server for one region, serving the exported repository with the GPU profile
# (config.pbtxt: onnxruntime or tensorrt_plan backend, KIND_GPU).
# Build: docker build -f deploy/triton.Dockerfile -t skewserve/triton .
ARG TRITON_VERSION=24.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3
COPY model_repository /models
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=10s --timeout=2s CMD curl -fsS http://127.0.0.1:8000/v2/health/ready || exit 1
# explicit model control: `skewserve rollout` loads new versions server by server with a canary check.
ENTRYPOINT ["tritonserver", "--model-repository=/models", "--model-control-mode=explicit", "--load-model=*", \
            "--strict-readiness=true", "--exit-timeout-secs=30", "--cache-config=local,size=268435456", \
            "--allow-metrics=true", "--allow-gpu-metrics=true"]
