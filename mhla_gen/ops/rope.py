"""Wan's interleaved rotary embedding (RoPE) of q and k: the plain reference, a lean PyTorch version and
the dispatch to a Triton kernel (``triton_rope.py``), behind one call, :func:`wan_rotary_pair`.

For each token ``t`` and coordinate pair ``(2i, 2i+1)`` of a head, ``c = freqs_cos[t, 2i]`` and
``s = freqs_sin[t, 2i+1]`` (``WanRotaryPosEmbed`` repeats each value twice)::

    y[2i]   = x[2i] c - x[2i+1] s
    y[2i+1] = x[2i] s + x[2i+1] c

computed in fp32 (float64 for float64 inputs) and rounded once to the input dtype. Three implementations,
bit-identical in forward and backward (the same products, sums and single rounding, in the same order):

* ``"reference"``: :func:`apply_wan_rotary`, plain differentiable torch ops (casts x to fp32, splits the
  pairs, ``torch.stack`` s the results, casts back: about nine passes over an fp32 copy of each tensor).
* ``"pytorch"``: :func:`rotate_pair_torch`, the same ops written into a preallocated output of the input
  dtype (as diffusers' ``WanAttnProcessor`` does): no fp32 copy of x, no stack, no final cast (the
  mixed-dtype products promote to fp32 exactly; the store rounds). Backward is the inverse rotation of
  the gradient, the same function with ``sin`` negated, in a :class:`torch.autograd.Function`.
* ``"triton"``: :func:`~mhla_gen.ops.triton_rope.rope_pair`, q and k in one launch that reads each once and
  writes each once; backward likewise.

Which runs (:func:`rope_backend`, default ``"auto"``): the kernel for CUDA tensors when Triton is
importable (``"pytorch"`` when it is not, or when ``MHLA_TRITON=0`` was set at import), the reference
elsewhere (CPU, meta) and while ``torch.compile`` / ``torch.export`` trace: inductor fuses the reference's
elementwise ops into one kernel of its own (and into the q/k norms around it), which an opaque custom op
would prevent; eager runs get the hand-written kernel.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
from torch import Tensor

from .triton_probe import triton_importable as _triton_importable

ROPE_BACKENDS = ("auto", "reference", "pytorch", "triton")
FAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# the process-wide backend; MHLA_TRITON=0 at import keeps "auto" off the kernel (read here, once)
_backend = "auto"
_triton_allowed = os.environ.get("MHLA_TRITON", "1") != "0"


def apply_wan_rotary(x: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Wan's interleaved RoPE, as in ``WanAttnProcessor``, computed in fp32 (or float64 for float64 x):
    the plain reference.

    Args:
        x: ``(B, heads, N, d)``; coordinate pairs ``(2i, 2i+1)`` are rotated together.
        freqs_cos, freqs_sin: ``(1, N, 1, d)`` from ``WanRotaryPosEmbed`` (each value repeated twice).
    Returns:
        ``(B, heads, N, d)`` in ``x.dtype``, contiguous.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    cos = freqs_cos.transpose(1, 2)[..., 0::2].to(dtype)  # (1, 1, N, d / 2)
    sin = freqs_sin.transpose(1, 2)[..., 1::2].to(dtype)
    x1, x2 = x.to(dtype).unflatten(-1, (-1, 2)).unbind(-1)  # even / odd coordinates, (B, heads, N, d / 2)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, heads, N, d / 2, 2)
    return rotated.flatten(-2).to(x.dtype)


def rotate_pair_torch(q: Tensor, k: Tensor, cos_half: Tensor, sin_half: Tensor,
                      inverse: bool = False) -> tuple[Tensor, Tensor]:
    """The ``"pytorch"`` implementation: :func:`apply_wan_rotary`'s arithmetic written into outputs of the
    input dtype. q, k ``(B, H, N, d)``; cos_half, sin_half ``(N, d / 2)``; returns ``(rq, rk)`` dense in
    the inputs' dimension order (``torch.empty_like``). ``inverse``: rotate by ``-sin``. Not itself
    differentiable (``out=``): :class:`_RotatePair` gives it a backward."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    cos = cos_half.to(dtype)
    sin = -sin_half.to(dtype) if inverse else sin_half.to(dtype)  # negation is exact
    return tuple(_rotate_into(x, cos, sin) for x in (q, k))


def _rotate_into(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``(B, H, N, d)`` x rotated by ``(N, d / 2)`` tables of the compute dtype, stored in x's dtype."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)  # views of x, (B, H, N, d / 2)
    out = torch.empty_like(x)
    # x1 * cos promotes x1 to the compute dtype exactly; the sum is rounded once, on the store into out
    torch.sub(x1 * cos, x2 * sin, out=out[..., 0::2])
    torch.add(x1 * sin, x2 * cos, out=out[..., 1::2])
    return out


class _RotatePair(torch.autograd.Function):
    """Rotation forward, inverse rotation of the gradients backward (the rotation is orthogonal per
    pair: its transpose is the rotation by ``-sin``). No gradient for the tables (Wan's are buffers)."""

    @staticmethod
    def forward(ctx, q, k, cos_half, sin_half, rotate: Callable):
        ctx.save_for_backward(cos_half, sin_half)
        ctx.rotate = rotate
        return rotate(q, k, cos_half, sin_half, inverse=False)

    @staticmethod
    def backward(ctx, grad_rq, grad_rk):
        cos_half, sin_half = ctx.saved_tensors
        dq, dk = ctx.rotate(grad_rq, grad_rk, cos_half, sin_half, inverse=True)
        return dq, dk, None, None, None


def wan_rotary_pair(q: Tensor, k: Tensor, freqs_cos: Tensor, freqs_sin: Tensor, *,
                    backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Wan's RoPE of q and k (:func:`apply_wan_rotary` on each), on the backend :func:`rope_backend` says.

    Args:
        q, k: ``(B, heads, N, d)`` of one shape and dtype, any strides (heads-interleaved views welcome).
        freqs_cos, freqs_sin: ``(1, N, 1, d)`` from ``WanRotaryPosEmbed``.
        backend: ``"auto"``, ``"reference"``, ``"pytorch"`` or ``"triton"``; None: the current one.
    Returns:
        ``(rq, rk)`` in the inputs' dtype; bit-identical across backends. The reference returns
        contiguous tensors, the others dense ones in the inputs' dimension order (``torch.empty_like``).
    """
    name = _resolve_backend(backend, q, k, freqs_cos, freqs_sin)
    if name == "reference":
        return apply_wan_rotary(q, freqs_cos, freqs_sin), apply_wan_rotary(k, freqs_cos, freqs_sin)
    cos_half, sin_half = freqs_cos[0, :, 0, 0::2], freqs_sin[0, :, 0, 1::2]  # (N, d / 2) views
    if name == "triton":
        from .triton_rope import rope_pair as rotate  # here, not at the top: importing it imports triton
    else:
        rotate = rotate_pair_torch
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RotatePair.apply(q, k, cos_half, sin_half, rotate)
    return rotate(q, k, cos_half, sin_half, inverse=False)


# --------------------------------------------------------------------------------------------------
# the switch


def get_rope_backend() -> str:
    """The backend :func:`wan_rotary_pair` calls without ``backend=`` use now (:func:`rope_backend`)."""
    return _backend


@contextlib.contextmanager
def rope_backend(name: str):
    """Run :func:`wan_rotary_pair` calls without a ``backend=`` argument on ``name`` inside the block
    (comparisons, tests). ``"triton"`` takes CPU tensors only under Triton's interpreter
    (``TRITON_INTERPRET=1``). Process-wide, not per thread; blocks nest. Under ``torch.compile`` the
    name is read while tracing: enter the block around the compiled call."""
    global _backend
    _check_backend(name)
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def _check_backend(name) -> None:
    if name not in ROPE_BACKENDS:
        raise ValueError(f"unknown RoPE backend {name!r}; choose one of {ROPE_BACKENDS}")


def _on_cuda(x: Tensor) -> bool:
    """Whether ``"auto"`` may run the kernel on x's device (a function: tests point it at the interpreter)."""
    return x.device.type == "cuda"


def _fast_paths_fit(q: Tensor, k: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> bool:
    """What the kernel and the lean PyTorch path take: q, k ``(B, H, N, d)`` of one shape and dtype,
    d even, tables ``(1, N, 1, d)`` that need no gradient."""
    if q.dim() != 4 or q.shape != k.shape or q.dtype != k.dtype or q.dtype not in FAST_DTYPES:
        return False
    n, d = q.shape[2:]
    tables_fit = all(t.shape == (1, n, 1, d) and t.is_floating_point() and not t.requires_grad
                     for t in (freqs_cos, freqs_sin))
    return d % 2 == 0 and tables_fit and freqs_cos.device == q.device == k.device == freqs_sin.device


def _resolve_backend(backend: str | None, q: Tensor, k: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> str:
    """``"reference"``, ``"pytorch"`` or ``"triton"``: what runs for these inputs under ``backend``."""
    name = _backend if backend is None else backend
    _check_backend(name)
    fits = _fast_paths_fit(q, k, freqs_cos, freqs_sin)
    if name == "auto":
        if torch.compiler.is_compiling() or not _on_cuda(q) or not fits:
            return "reference"
        return "triton" if _triton_allowed and _triton_importable() else "pytorch"
    if name in ("pytorch", "triton") and not fits:
        raise ValueError(
            f"RoPE backend {name!r} needs q, k (B, heads, N, d) of one shape and a dtype of {FAST_DTYPES}, "
            f"d even, and (1, N, 1, d) tables without gradient on their device; got q {tuple(q.shape)} "
            f"{q.dtype}, k {tuple(k.shape)} {k.dtype}, tables {tuple(freqs_cos.shape)}"
        )
    if name == "triton" and not _triton_importable():
        raise ValueError("RoPE backend 'triton' needs Triton, which is not importable here")
    return name
