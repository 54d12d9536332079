"""What the op's implementations share: argument validation (clear ValueErrors), the accumulation
dtype, autocast handling and the mixing GEMM."""

from __future__ import annotations

import contextlib

import torch

from .layout import BlockLayout


def check_inputs(q, k, v, layout: BlockLayout, mixing: torch.Tensor, causal: bool) -> None:
    if not isinstance(layout, BlockLayout):
        raise ValueError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, tokens, dim), got shape {tuple(t.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k shapes differ: q {tuple(q.shape)} vs k {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v shape {tuple(v.shape)} does not match k {tuple(k.shape)} in (batch, heads, tokens)"
        )
    layout.check_tokens(q.shape[2], "number of tokens")
    m = layout.num_blocks
    if mixing.shape != (m, m):
        raise ValueError(f"mixing must have shape ({m}, {m}) for {layout}, got {tuple(mixing.shape)}")
    if causal and layout.ndim != 1:
        raise ValueError(f"causal=True needs a 1D layout (chunks of a sequence), got grid {layout.grid}")
    if not q.is_floating_point():
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 summaries under half precision; float32/float64 inputs keep their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def cast_output(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Back to the input dtype; fp16 is clipped first (as diffusers' SANA processor does)."""
    if dtype == torch.float16:
        out = out.clip(-65504, 65504)
    return out.to(dtype)


def autocast_off(device_type: str):
    """A context with autocast off on ``device_type`` when it is on (the op picks its own precision:
    fp32 sums for half inputs; autocast would halve it). Devices without autocast (meta) get a no-op."""
    if device_type in ("cpu", "cuda", "xpu", "mps") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def mix_blocks(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``Σ_j w[i, j] x[j]``: one GEMM ``(M, M) @ (M, rest)`` on ``x``'s ``(M, -1)`` view, for ``x``
    ``(M, ...)`` or block-major stacked ``(M·B·H, ...)`` (block ``j``'s rows together); ``x`` contiguous."""
    return (w @ x.view(w.shape[1], -1)).view_as(x)
