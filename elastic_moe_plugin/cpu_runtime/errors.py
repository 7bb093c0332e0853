"""The one error type of the CPU runtime."""


class MegatronCPUError(RuntimeError):
    """The CPU runtime cannot do what was asked: it is off, CUDA is available without ``force``, a
    GPU-only kernel it stands in for was launched, or the process-group layout is not one it serves."""


__all__ = ["MegatronCPUError"]
