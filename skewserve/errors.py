"""Exception tree of the local stack.

SkewserveError
 +-- TritonNotInstalled      the tritonserver binary or a backend stub is missing
 +-- TritonStartError        a server did not become ready (exited, timed out, port taken)
 |    +-- PortInUse
 |    +-- ModelLoadError     Triton's own reason is in the message
"""


class SkewserveError(Exception):
    """Base of every error the local stack raises on purpose."""


class TritonNotInstalled(SkewserveError):
    pass


class TritonStartError(SkewserveError):
    pass


class PortInUse(TritonStartError):
    pass


class ModelLoadError(TritonStartError):
    pass
