"""The one pin of the production serving target: NGC Triton image tag and the TensorRT inside it.

TensorRT plans only load on the TensorRT version (and GPU compute capability) they were built for,
so the exporter, the model card, the Dockerfiles, compose and the Kubernetes manifests all name the
image from here. Change the pin here, then run `pytest tests/deploy`: it fails on every file that
still names the old tag. Versions from NVIDIA's Triton release notes (release 24.10 = Triton
2.51.0, TensorRT 10.5.0.18, CUDA 12.6.2).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TRITON_REGISTRY = "nvcr.io/nvidia/tritonserver"


@dataclass(frozen=True)
class ServingTarget:
    release: str  # NGC container release, YY.MM
    triton_version: str
    tensorrt_version: str
    cuda_version: str

    @property
    def image_tag(self) -> str:
        return f"{self.release}-py3"

    @property
    def image(self) -> str:
        return f"{TRITON_REGISTRY}:{self.image_tag}"

    def as_dict(self) -> dict[str, str]:
        return {**asdict(self), "image": self.image}


TARGET = ServingTarget(
    release="24.10", triton_version="2.51.0", tensorrt_version="10.5.0.18", cuda_version="12.6.2"
)
