"""Exception tree of the exporter.

ExportError
 +-- ParityError        the compiled model disagrees with PyTorch; the message has the figures
 +-- PublishError       a version cannot be published (exists, lock, bad repository)
 +-- TensorRTUnavailable  --tensorrt on without a CUDA GPU or the tensorrt package
"""


class ExportError(Exception):
    pass


class ParityError(ExportError):
    pass


class PublishError(ExportError):
    pass


class TensorRTUnavailable(ExportError):
    pass
