"""skewserve: train on skewed data, compile for NVIDIA Triton, serve across regions under skewed load."""

__version__ = "0.1.0"
