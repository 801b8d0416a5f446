"""Artifact -> ONNX (FP32/FP16) [-> TensorRT] -> parity-checked, versioned Triton model repository."""
