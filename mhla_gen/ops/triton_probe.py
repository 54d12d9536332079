"""Whether ``import triton`` works, found out once, on first need: the op's and RoPE's dispatchers ask
before they choose a kernel (the package imports without triton; the reference paths need none). They ask
only for CUDA inputs (or a backend named ``"triton"``), so a machine without triton hears once, at the
first CUDA call, that MHLA runs its slower PyTorch path there."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_importable: bool | None = None


def triton_importable() -> bool:
    # a module global rather than functools.cache: torch.compile traces this without a warning
    global _importable
    if _importable is None:
        try:
            import triton  # noqa: F401
        except ImportError as err:
            _importable = False
            logger.warning("triton does not import (%s): MHLA and its RoPE run their PyTorch paths on CUDA, "
                           "slower than the Triton kernels; install triton to use them", err)
        else:
            _importable = True
    return _importable
