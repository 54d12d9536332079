"""When the registered op runs the Triton kernels (``triton_mhla.py``), and the glue to them.

The op (``mhla.py``) asks :func:`supports` in its implementation *and* in its fake (shape) function, so
compiled graphs allocate exactly what the chosen implementation returns. Triton is imported only when a
CUDA tensor asks for it: ``import mhla_gen`` and CPU runs never import it.

``MHLA_TRITON=0`` in the environment (read when the op runs, so set it before compiling) sends CUDA
tensors to the PyTorch implementation too: for comparisons and for debugging the kernels.
"""

from __future__ import annotations

import functools
import os

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def enabled() -> bool:
    """False when ``MHLA_TRITON=0`` is set."""
    return os.environ.get("MHLA_TRITON", "1") != "0"


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """CUDA tensors of one dtype of fp32/fp16/bf16 with value dim = key dim (the kernels' contract),
    Triton installed, and not switched off. Everything else runs ``blocked.py``."""
    return (
        q.device.type == "cuda"
        and q.dtype in KERNEL_DTYPES
        and k.dtype == v.dtype == q.dtype
        and v.shape[-1] == q.shape[-1]
        and enabled()
        and _triton_importable()
    )


def forward(q, k, v, mixing, grid, blocks, feature_map: str, normalize: bool, eps: float):
    """``(out, mixed_kv, mixed_k, den)`` from :func:`triton_mhla.mhla_forward_triton`."""
    from . import triton_mhla

    return triton_mhla.mhla_forward_triton(q, k, v, mixing, grid, blocks, feature_map, normalize, eps)


def outputs_like(q, v, blocks, normalize: bool):
    """Empty tensors shaped, typed and strided as :func:`forward` returns them (for the op's fake)."""
    from . import triton_mhla

    return triton_mhla.forward_outputs_like(q, v, blocks, normalize)


def backward(grad_out, q, k, v, mixing, out, saved0, saved1, saved2, grid, blocks, feature_map: str,
             normalize: bool, eps: float, needs):
    """``(dq, dk, dv, dmixing)`` (None where not needed) from :func:`triton_mhla.mhla_backward_triton`;
    ``saved*`` are the forward's ``(mixed_kv, mixed_k, den)``."""
    from . import triton_mhla

    return triton_mhla.mhla_backward_triton(
        grad_out, q, k, v, mixing, out, saved0, saved1, saved2, grid, blocks, feature_map, normalize, eps,
        needs,
    )


def backward_outputs_like(q, k, v, mixing, needs):
    """Empty gradients (None where not needed) shaped, typed and strided as :func:`backward` returns."""
    from . import triton_mhla

    return triton_mhla.backward_outputs_like(q, k, v, mixing, needs)
