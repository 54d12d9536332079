"""``mhla_attention``: the MHLA operator, its registered op and the op's contract with its backends.

Non-causal MHLA with a named feature map runs as one registered op, ``torch.ops.mhla_gen.mhla``
(``torch.library.custom_op`` with a fake implementation and a registered autograd formula whose
backward is the op ``mhla_gen::mhla_backward``). ``torch.compile`` (``fullgraph=True``), ``torch.export``
and CUDA graphs see one opaque node per layer, so MHLA models compile like stock ones.

Two backends implement the op, behind one contract (:class:`Saved` and the four functions below):

* ``"pytorch"``: ``blocked.py``, sub-grid by sub-grid in PyTorch; any device and float dtype.
* ``"triton"``: ``triton_mhla.py``, Triton kernels for CUDA tensors of one dtype of fp32/fp16/bf16 with
  value dim = key dim. Imported on first use only: ``import mhla_gen`` and CPU runs never import Triton.

Each backend module defines, with the same arguments in the same order::

    forward(q, k, v, grid, blocks, mixing, feature_map, normalize, eps) -> (out, state, norm, den)
    forward_outputs_like(q, v, blocks, normalize)                       -> the same, empty
    backward(grad_out, q, k, v, grid, blocks, mixing, feature_map, normalize, eps,
             out, state, norm, den, needs)                              -> (dq, dk, dv, dmixing)
    backward_outputs_like(q, k, v, mixing, needs)                       -> the same, empty

The ``*_outputs_like`` functions return empty tensors with the shapes, dtypes and strides of the real
results: they are the op's fake implementations, what compiled graphs allocate. ``needs`` says which of
(q, k, v, mixing) need a gradient; the others come back as None.

The backend is chosen once, in :func:`mhla_attention`, and passed to the op as an argument; the autograd
formula hands the same name to the backward op, so backward always runs what the forward ran and reads
the tensors that backend saved.

Causal MHLA and callable feature maps run :func:`mhla_attention_autograd` (``autograd_path.py``): the
same math in plain differentiable torch ops, which torch.compile traces like any other model code.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from ..layout import BlockLayout
from . import blocked
from .autograd_path import mhla_attention_autograd
from .checks import check_inputs
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
    backend = "triton" if _kernels_apply(q, k, v) else "pytorch"
    out, *_ = torch.ops.mhla_gen.mhla(
        q, k, v, list(layout.grid), list(layout.blocks), mixing, feature_map, normalize, eps, backend
    )
    return out


# --------------------------------------------------------------------------------------------------
# the contract between the op and its backends


class Saved(NamedTuple):
    """What the op's forward returns after ``out`` for its backward: outputs 1-3 of
    ``torch.ops.mhla_gen.mhla``, inputs of ``mhla_gen::mhla_backward`` and of each backend's ``backward``.

    All three are in the accumulation dtype (fp32 for bf16/fp16 inputs), never need a gradient, and are
    read only by the ``backward`` of the backend whose ``forward`` made them. ``M`` blocks, ``c = e + 1``
    with the normaliser (else ``e``); an unused slot is an empty tensor (outputs of a custom op may not
    be None, nor alias each other).

    Attributes:
        state: the block states backward starts from.
            pytorch: ``(M, B, H, c, d)``, ``[S z]ᵀ`` per block in sub-grid block order (the normaliser
            ``z`` is row ``e``), mixed ``(W [S z])ᵀ`` or not (``blocked.saves_summaries``).
            triton: ``(B, H, M, d, e)``, the mixed ``S̃``, a view of ``(M, B, H, d, e)`` memory.
        norm: the mixed normaliser ``z̃``.
            pytorch: empty (``z`` is a row of ``state``).
            triton: ``(B, H, M, d)``, a view of ``(M, B, H, d)`` memory; empty without the normaliser.
        den: ``(B, H, N)``, ``φ(q_t)·z̃_{b(t)} + eps`` per token (both backends); empty without the
            normaliser.
    """

    state: Tensor
    norm: Tensor
    den: Tensor


# --------------------------------------------------------------------------------------------------
# the backends


KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernels_apply(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """CUDA tensors of one dtype of fp32/fp16/bf16 with value dim = key dim (the kernels' contract),
    Triton installed, and not switched off (``MHLA_TRITON=0``)."""
    return (
        q.device.type == "cuda"
        and q.dtype in KERNEL_DTYPES
        and k.dtype == v.dtype == q.dtype
        and v.shape[-1] == q.shape[-1]
        and os.environ.get("MHLA_TRITON", "1") != "0"
        and _triton_importable()
    )


def _backend_module(backend: str) -> ModuleType:
    """The module implementing ``backend`` (see the module docstring for what it defines)."""
    if backend == "pytorch":
        return blocked
    if backend == "triton":
        from . import triton_mhla  # here, not at the top: importing it imports triton

        return triton_mhla
    raise ValueError(f"unknown MHLA backend {backend!r}; choose 'pytorch' or 'triton'")


# --------------------------------------------------------------------------------------------------
# the registered op


@torch.library.custom_op("mhla_gen::mhla", mutates_args=())
def _mhla_op(
    q: Tensor, k: Tensor, v: Tensor, grid: list[int], blocks: list[int], mixing: Tensor, feature_map: str,
    normalize: bool, eps: float, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, *Saved)``: the output ``(B, H, N, e)`` and what the backend's backward reads."""
    return _backend_module(backend).forward(q, k, v, grid, blocks, mixing, feature_map, normalize, eps)


@_mhla_op.register_fake
def _mhla_op_fake(q, k, v, grid, blocks, mixing, feature_map, normalize, eps, backend):
    return _backend_module(backend).forward_outputs_like(q, v, blocks, normalize)


@torch.library.custom_op("mhla_gen::mhla_backward", mutates_args=())
def _mhla_backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, grid: list[int], blocks: list[int], mixing: Tensor,
    feature_map: str, normalize: bool, eps: float, backend: str, out: Tensor, state: Tensor, norm: Tensor,
    den: Tensor, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dmixing)``; an entry whose ``needs`` is False is an empty tensor."""
    grads = _backend_module(backend).backward(
        grad_out, q, k, v, grid, blocks, mixing, feature_map, normalize, eps, out, state, norm, den, needs
    )
    return _fill_unneeded(grads, (q, k, v, mixing))


@_mhla_backward_op.register_fake
def _mhla_backward_op_fake(grad_out, q, k, v, grid, blocks, mixing, feature_map, normalize, eps, backend,
                           out, state, norm, den, needs):
    grads = _backend_module(backend).backward_outputs_like(q, k, v, mixing, needs)
    return _fill_unneeded(grads, (q, k, v, mixing))


def _fill_unneeded(grads, inputs) -> tuple[Tensor, ...]:
    """None -> an empty tensor (the op's outputs are tensors)."""
    return tuple(g if g is not None else x.new_empty(0) for g, x in zip(grads, inputs))


def _setup_context(ctx, inputs, output):
    q, k, v, grid, blocks, mixing, feature_map, normalize, eps, backend = inputs
    out, *saved = output
    saved = Saved(*saved)
    ctx.save_for_backward(q, k, v, mixing, out, *saved)
    # The saved tensors are outputs only so that backward can read them: no gradient flows into them,
    # and autograd must not materialise zero gradients for them (an (M, B, H, c, d) fill per call).
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.args = (grid, blocks, feature_map, normalize, eps, backend)  # backend: what the forward ran


def _backward(ctx, grad_out, *unused_grads):
    if grad_out is None:  # the output took no part in the loss (grads are not materialised)
        return (None,) * 10
    q, k, v, mixing, out, *saved = ctx.saved_tensors
    grid, blocks, feature_map, normalize, eps, backend = ctx.args
    saved = Saved(*saved)
    needs = [ctx.needs_input_grad[i] for i in (0, 1, 2, 5)]  # q, k, v, mixing
    dq, dk, dv, dmixing = torch.ops.mhla_gen.mhla_backward(
        grad_out, q, k, v, grid, blocks, mixing, feature_map, normalize, eps, backend,
        out, saved.state, saved.norm, saved.den, needs,
    )
    need_q, need_k, need_v, need_w = needs
    return (dq if need_q else None, dk if need_k else None, dv if need_v else None, None, None,
            dmixing if need_w else None, None, None, None, None)


_mhla_op.register_autograd(_backward, setup_context=_setup_context)


__all__ = ["FEATURE_MAPS", "Saved", "mhla_attention", "mhla_attention_autograd"]
