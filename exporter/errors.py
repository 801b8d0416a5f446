"""Exception tree of the exporter (publishing errors are the repository's: repository/errors.py).

ExportError
 +-- ParityError        the compiled model disagrees with PyTorch; the message has the figures
 +-- TensorRTUnavailable  --tensorrt on without a CUDA GPU or the tensorrt package
"""


class ExportError(Exception):
    pass


class ParityError(ExportError):
    pass


class TensorRTUnavailable(ExportError):
    pass
