"""``mhla_attention``: the MHLA operator.

Non-causal MHLA with a named feature map runs as one registered op, ``torch.ops.mhla_gen.mhla``
(``torch.library.custom_op`` with fake shapes and a registered autograd formula whose backward is the
op ``mhla_gen::mhla_backward``). ``torch.compile`` (``fullgraph=True``), ``torch.export`` and CUDA graphs
see one opaque node per layer, so MHLA models compile like stock ones; the op runs its PyTorch
implementation (``blocked.py``) on CPU and on GPUs without Triton, and the Triton kernels on CUDA.

Causal MHLA and callable feature maps run :func:`mhla_attention_autograd` (``autograd_path.py``): the
same math in plain differentiable torch ops, which torch.compile traces like any other model code.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..layout import BlockLayout
from . import blocked
from .autograd_path import mhla_attention_autograd
from .checks import accumulation_dtype, check_inputs
from .feature_maps import FEATURE_MAPS, get_feature_map


def mhla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    mixing: torch.Tensor,
    feature_map="relu",
    normalize: bool = True,
    causal: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Multi-head linear attention over the blocks of ``layout``.

    Args:
        q, k: ``(B, H, N, d)``; v: ``(B, H, N, e)``; tokens in row-major grid order; any strides.
        layout: the block partition of the ``N`` tokens.
        mixing: ``(M, M)``; ``mixing[i, j]`` weights key block ``j``'s summary for query block ``i``.
        feature_map: ``"relu"``, ``"elu+1"``, ``"relu+1e-6"``, ``"identity"`` or a callable.
        normalize: divide by ``φ(q)ᵀ z̃ + eps`` (False: numerator only, as the Wan release does).
        causal: 1D only; blocks are chunks and token ``t`` sees keys ``s <= t``.
    Returns:
        ``(B, H, N, e)`` in q's dtype. Summaries accumulate in fp32 for bf16/fp16 inputs, also under
        ``torch.autocast``.
    """
    check_inputs(q, k, v, layout, mixing, causal)
    if causal or not isinstance(feature_map, str):
        return mhla_attention_autograd(q, k, v, layout, mixing, feature_map, normalize, causal, eps)
    get_feature_map(feature_map)  # unknown names raise here, naming the choices
    out, *_ = torch.ops.mhla_gen.mhla(
        q, k, v, mixing, list(layout.grid), list(layout.blocks), feature_map, normalize, eps
    )
    return out


# --------------------------------------------------------------------------------------------------
# the registered op


def _use_triton(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the op runs the Triton kernels (CUDA, half/single precision, key dim = value dim)."""
    from . import triton_dispatch

    return triton_dispatch.supports(q, k, v)


@torch.library.custom_op("mhla_gen::mhla", mutates_args=())
def _mhla_op(
    q: Tensor, k: Tensor, v: Tensor, mixing: Tensor, grid: list[int], blocks: list[int], feature_map: str,
    normalize: bool, eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, *saved)``: the output and three tensors for backward, in the implementation's format."""
    if _use_triton(q, k, v):
        from . import triton_dispatch

        return triton_dispatch.forward(q, k, v, mixing, grid, blocks, feature_map, normalize, eps)
    out, saved, den = blocked.forward(q, k, v, mixing, grid, blocks, feature_map, normalize, eps)
    return out, saved, den, q.new_empty(0)


@_mhla_op.register_fake
def _mhla_op_fake(q, k, v, mixing, grid, blocks, feature_map, normalize, eps):
    (b, h, n, e), d = v.shape, q.shape[-1]
    if _use_triton(q, k, v):
        from . import triton_dispatch

        return triton_dispatch.outputs_like(q, v, blocks, normalize)
    out = blocked.empty_output(q, v)
    acc = accumulation_dtype(q.dtype)
    saved = q.new_empty(math.prod(blocks), b, h, e + normalize, d, dtype=acc)  # Ŝᵀ or (W Ŝ)ᵀ
    den = q.new_empty(b, h, n, dtype=acc) if normalize else q.new_empty(0, dtype=acc)
    return out, saved, den, q.new_empty(0)


@torch.library.custom_op("mhla_gen::mhla_backward", mutates_args=())
def _mhla_backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, mixing: Tensor, out: Tensor, saved0: Tensor,
    saved1: Tensor, saved2: Tensor, grid: list[int], blocks: list[int], feature_map: str, normalize: bool,
    eps: float, needs: list[bool], triton: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dmixing)``; an entry whose ``needs`` is False is an empty tensor. ``triton``: the
    forward ran the Triton kernels (decided once, in the forward: the saved tensors are theirs)."""
    if triton:
        from . import triton_dispatch

        grads = triton_dispatch.backward(
            grad_out, q, k, v, mixing, out, saved0, saved1, saved2, grid, blocks, feature_map, normalize,
            eps, needs,
        )
    else:
        grads = blocked.backward(
            grad_out, q, k, v, mixing, out, saved0, saved1, grid, blocks, feature_map, normalize, tuple(needs)
        )
    return tuple(g if g is not None else x.new_empty(0) for g, x in zip(grads, (q, k, v, mixing)))


@_mhla_backward_op.register_fake
def _mhla_backward_op_fake(grad_out, q, k, v, mixing, out, saved0, saved1, saved2, grid, blocks,
                           feature_map, normalize, eps, needs, triton):
    if triton:
        from . import triton_dispatch

        grads = triton_dispatch.backward_outputs_like(q, k, v, mixing, needs)
    else:  # blocked.backward: torch.empty_like of each input (its strides)
        grads = tuple(torch.empty_like(x) if need else None for x, need in zip((q, k, v, mixing), needs))
    return tuple(g if g is not None else x.new_empty(0) for g, x in zip(grads, (q, k, v, mixing)))


def _setup_context(ctx, inputs, output):
    q, k, v, mixing, grid, blocks, feature_map, normalize, eps = inputs
    out, *saved = output
    ctx.save_for_backward(q, k, v, mixing, out, *saved)
    # The saved tensors are outputs only so that backward can read them: no gradient flows into them,
    # and autograd must not materialise zero gradients for them (an (M, B, H, c, d) fill per call).
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.args = (grid, blocks, feature_map, normalize, eps)
    ctx.triton = _use_triton(q, k, v)  # what the forward ran (MHLA_TRITON may change before backward)


def _backward(ctx, grad_out, *unused_grads):
    if grad_out is None:  # the output took no part in the loss (grads are not materialised)
        return (None,) * 9
    q, k, v, mixing, out, *saved = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    grads = torch.ops.mhla_gen.mhla_backward(
        grad_out, q, k, v, mixing, out, *saved, *ctx.args, needs, ctx.triton
    )
    return *(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None


_mhla_op.register_autograd(_backward, setup_context=_setup_context)


__all__ = ["FEATURE_MAPS", "mhla_attention", "mhla_attention_autograd"]
