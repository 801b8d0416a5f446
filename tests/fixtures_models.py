"""The tiny Python-backend models tests write (skewserve/sample_models.py)."""

from skewserve.sample_models import AFFINE_MODEL_PY, CONFIG, write_affine_model

__all__ = ["AFFINE_MODEL_PY", "CONFIG", "write_affine_model"]
