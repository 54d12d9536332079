"""When the registered op runs the Triton kernels, and the glue to them (``triton_mhla.py``)."""

from __future__ import annotations

import torch


def supports(q: torch.Tensor, v: torch.Tensor) -> bool:
    """CUDA tensors the kernels handle. Until the kernels land, nothing: every device runs ``blocked``."""
    return False
