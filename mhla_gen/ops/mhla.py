"""``mhla_attention``: the MHLA operator, its registered op and the op's contract with its backends.

Non-causal MHLA with a named feature map runs as one registered op, ``torch.ops.mhla_gen.mhla``
(``torch.library.custom_op`` with a fake implementation and a registered autograd formula whose
backward is the op ``mhla_gen::mhla_backward``). ``torch.compile`` (``fullgraph=True``), ``torch.export``
and CUDA graphs see one opaque node per layer, so MHLA models compile like stock ones.

Two backends implement the op, behind one contract (:class:`Saved` and the four functions below):

* ``"pytorch"``: ``blocked.py``, sub-grid by sub-grid in PyTorch; any device and float dtype.
* ``"triton"``: ``triton_backend.py``, Triton kernels for CUDA tensors of one dtype of fp32/fp16/bf16 with
  value dim = key dim: the dense path for small N (``triton_dense.py``) or the blocked kernels
  (``triton_mhla.py``), chosen from static shapes. Imported on first use: ``import mhla_gen`` and CPU runs
  never import it (nor Triton through it).

Each backend module defines, with the same arguments in the same order::

    forward(q, k, v, grid, blocks, mixing, feature_map, normalize, eps) -> (out, state, norm, den)
    forward_outputs_like(q, v, blocks, normalize)                       -> the same, empty
    backward(grad_out, q, k, v, grid, blocks, mixing, feature_map, normalize, eps,
             out, state, norm, den, needs)                              -> (dq, dk, dv, dmixing)
    backward_outputs_like(q, k, v, mixing, needs)                       -> the same, empty
    backward_reads_out(state) -> bool   whether backward reads ``out`` for the forward that saved
                                        ``state`` (else the op keeps an empty tensor in its place)

The ``*_outputs_like`` functions return empty tensors with the shapes, dtypes and strides of the real
results: they are the op's fake implementations, what compiled graphs allocate. ``needs`` says which of
(q, k, v, mixing) need a gradient; the others come back as None.

Which backend runs: ``mhla_attention(..., backend=)`` or, for calls without it, the innermost
``with mhla_backend(name):`` block, else the process default: ``"auto"`` (the kernels where they apply,
else PyTorch), or ``"pytorch"`` when ``MHLA_TRITON=0`` is set at import. The name is resolved once, in
:func:`mhla_attention`, to ``"pytorch"`` or ``"triton"`` and passed to the op as an argument; the autograd
formula hands the same name to the backward op, so backward always runs what the forward ran and reads
the tensors that backend saved.

Plain eager calls skip the op's dispatcher: :func:`mhla_attention` calls the backend's ``forward`` (no
grad) or both through a lean ``autograd.Function`` (``_EagerMHLA``) with the op's arguments, so results and
gradients are bit-identical to the op's, at a fraction of its host time per call. Compiled, exported and
traced code, dispatch modes and tensor subclasses get the op (``_plain_eager_call``).

Causal MHLA and callable feature maps run :func:`mhla_attention_autograd` (``autograd_path.py``): the
same math in plain differentiable torch ops, which torch.compile traces like any other model code.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from . import blocked
from .autograd_path import mhla_attention_autograd
from .checks import check_inputs
from .feature_maps import FEATURE_MAPS, get_feature_map
from .layout import BlockLayout
from .triton_probe import triton_importable as _triton_importable


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
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Multi-head linear attention over the blocks of ``layout``.

    Args:
        q, k: ``(B, H, N, d)``; v: ``(B, H, N, e)``; tokens in row-major grid order; any strides.
        layout: the block partition of the ``N`` tokens.
        mixing: ``(M, M)``; ``mixing[i, j]`` weights key block ``j``'s summary for query block ``i``.
        feature_map: ``"relu"``, ``"elu+1"``, ``"relu+1e-6"``, ``"identity"`` or a callable.
        normalize: divide by ``φ(q)ᵀ z̃ + eps`` (False: numerator only, as the Wan release does).
        causal: 1D only; blocks are chunks and token ``t`` sees keys ``s <= t``.
        backend: ``"auto"``, ``"pytorch"`` or ``"triton"`` (:func:`mhla_backend`); None: the current one.
            Causal calls and callable feature maps ignore it (they run ``autograd_path.py``).
    Returns:
        ``(B, H, N, e)`` in q's dtype. Summaries accumulate in fp32 for bf16/fp16 inputs, also under
        ``torch.autocast``.
    """
    check_inputs(q, k, v, layout, mixing, causal)
    if causal or not isinstance(feature_map, str):
        return mhla_attention_autograd(q, k, v, layout, mixing, feature_map, normalize, causal, eps)
    get_feature_map(feature_map)  # unknown names raise here, naming the choices
    backend = _resolve_backend(backend, q, k, v)
    if _plain_eager_call(q, k, v, mixing):
        return _eager_mhla(q, k, v, layout.grid, layout.blocks, mixing, feature_map, normalize, eps, backend)
    out, *_ = torch.ops.mhla_gen.mhla(
        q, k, v, list(layout.grid), list(layout.blocks), mixing, feature_map, normalize, eps, backend
    )
    return out


# --------------------------------------------------------------------------------------------------
# the contract between the op and its backends


class Saved(NamedTuple):
    """What the op's forward returns after ``out`` for its backward: outputs 1-3 of
    ``torch.ops.mhla_gen.mhla``, inputs of ``mhla_gen::mhla_backward`` and of each backend's ``backward``.

    None needs a gradient, and each is read only by the ``backward`` of the backend whose ``forward``
    made it. ``M`` blocks, ``c = e + 1`` with the normaliser (else ``e``); an unused slot is an empty
    tensor (outputs of a custom op may not be None, nor alias each other). The op also saves ``out`` where
    the backend's ``backward_reads_out(state)`` says so (pytorch; triton's dense path), an empty tensor in
    its place otherwise (triton's blocked path: ``G·o`` comes from the states).

    Attributes:
        state: the block states backward starts from.
            pytorch: ``(M, B, H, c, d)`` in the accumulation dtype (fp32 for bf16/fp16 inputs), ``[S z]ᵀ``
            per block in sub-grid block order (the normaliser ``z`` is row ``e``), mixed ``(W [S z])ᵀ`` or
            not (``blocked.saves_summaries``).
            triton: ``(B, H, M, d, e)``, the unmixed ``S`` in ``triton_mhla.state_dtype`` (bf16 for bf16
            inputs, else fp32), a view of ``(M, B, H, d, e)`` memory; empty on the dense path (small N,
            ``triton_dense.py``), which needs no state (and is recognised by it).
        norm: the normaliser.
            pytorch: empty (``z`` is a row of ``state``).
            triton: ``(B, H, M, d)`` fp32, the unmixed ``z``, a view of ``(M, B, H, d)`` memory; empty
            without the normaliser and on the dense path.
        den: ``(B, H, N)`` in the accumulation dtype, ``φ(q_t)·z̃_{b(t)} + eps`` per token (both backends;
            the dense path's ``Σ_s A[t, s] + eps`` is the same number); empty without the normaliser.
    """

    state: Tensor
    norm: Tensor
    den: Tensor


# --------------------------------------------------------------------------------------------------
# the backends and the switch between them

BACKENDS = ("auto", "pytorch", "triton")
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The process-wide backend; MHLA_TRITON=0 at import makes the default "pytorch" (read here, once).
_backend = "pytorch" if os.environ.get("MHLA_TRITON", "1") == "0" else "auto"


def _check_backend(name) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown MHLA backend {name!r}; choose one of {BACKENDS}")


def get_mhla_backend() -> str:
    """The backend :func:`mhla_attention` calls without ``backend=`` use now (:func:`mhla_backend`)."""
    return _backend


@contextlib.contextmanager
def mhla_backend(name: str):
    """Run :func:`mhla_attention` calls without a ``backend=`` argument on ``name`` inside the block.

    ``"auto"``: the Triton kernels for CUDA tensors where they apply (one dtype of fp32/fp16/bf16, value
    dim = key dim, Triton installed), else PyTorch. ``"pytorch"``: ``blocked.py`` everywhere (comparisons,
    debugging the kernels). ``"triton"``: the kernels, or a ValueError for inputs outside their contract
    (they take CPU tensors only under Triton's interpreter, ``TRITON_INTERPRET=1``).

    Like diffusers' ``attention_backend``: process-wide, not per thread; blocks nest. The backend is read
    when a call starts; a backward runs what its forward ran, whatever the backend is by then. Under
    ``torch.compile`` it is read while tracing and the graph is guarded on it: enter the block around the
    compiled call (a different backend retraces), not inside the compiled function.
    """
    global _backend
    _check_backend(name)
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def _kernels_fit(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """The kernels' contract: q, k, v of one dtype of fp32/fp16/bf16, value dim = key dim."""
    return q.dtype in KERNEL_DTYPES and k.dtype == v.dtype == q.dtype and v.shape[-1] == q.shape[-1]


def _resolve_backend(backend: str | None, q: Tensor, k: Tensor, v: Tensor) -> str:
    """``"pytorch"`` or ``"triton"``: what the op runs for these inputs under ``backend`` (None: the
    current one). ``"auto"`` checks the device first, so CPU calls never try to import Triton here."""
    name = _backend if backend is None else backend
    _check_backend(name)
    if name == "auto":
        use = q.device.type == "cuda" and _kernels_fit(q, k, v) and _triton_importable()
        return "triton" if use else "pytorch"
    if name == "triton" and not (_kernels_fit(q, k, v) and _triton_importable()):
        raise ValueError(
            "backend 'triton' needs Triton and q, k, v of one dtype of fp32/fp16/bf16 with value dim = key "
            f"dim; got {q.dtype}, {k.dtype}, {v.dtype}, d={q.shape[-1]}, e={v.shape[-1]}"
        )
    return name


def _backend_module(backend: str) -> ModuleType:
    """The module implementing ``backend`` (see the module docstring for what it defines)."""
    if backend == "pytorch":
        return blocked
    if backend == "triton":
        from . import triton_backend  # here, not at the top: importing it imports triton

        return triton_backend
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
    if not _backend_module(backend).backward_reads_out(saved.state):
        out = out.new_empty(0)  # its backward does not read out (triton blocked: G·o from the states)
    ctx.save_for_backward(q, k, v, mixing, out, *saved)
    # The saved tensors are outputs only so that backward can read them: no gradient flows into them,
    # and autograd must not materialise zero gradients for them (an (M, B, H, c, d) fill per call).
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.args = (grid, blocks, feature_map, normalize, eps, backend)  # backend: what the forward ran


def _backward(ctx, grad_out, *unused_grads):
    return _gradients(ctx, grad_out, torch.ops.mhla_gen.mhla_backward)


def _gradients(ctx, grad_out, run_backward) -> tuple:
    """The op's autograd formula with ``run_backward`` (the backward op, or :func:`_backend_backward` on the
    eager path) computing ``(dq, dk, dv, dmixing)`` from what ``_setup_context`` saved."""
    if grad_out is None:  # the output took no part in the loss (grads are not materialised)
        return (None,) * 10
    q, k, v, mixing, out, *saved = ctx.saved_tensors
    grid, blocks, feature_map, normalize, eps, backend = ctx.args
    saved = Saved(*saved)
    needs = [ctx.needs_input_grad[i] for i in (0, 1, 2, 5)]  # q, k, v, mixing
    dq, dk, dv, dmixing = run_backward(
        grad_out, q, k, v, grid, blocks, mixing, feature_map, normalize, eps, backend,
        out, saved.state, saved.norm, saved.den, needs,
    )
    need_q, need_k, need_v, need_w = needs
    return (dq if need_q else None, dk if need_k else None, dv if need_v else None, None, None,
            dmixing if need_w else None, None, None, None, None)


def _backend_backward(grad_out, q, k, v, grid, blocks, mixing, feature_map, normalize, eps, backend, out,
                      state, norm, den, needs):
    """What ``mhla_gen::mhla_backward`` computes, without the op (None where ``needs`` is False)."""
    return _backend_module(backend).backward(
        grad_out, q, k, v, grid, blocks, mixing, feature_map, normalize, eps, out, state, norm, den, needs
    )


_mhla_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# the eager path: the same backend calls without the op's dispatcher
#
# In eager mode a call through ``torch.ops.mhla_gen.mhla`` pays for the custom-op machinery (schema
# parsing, the Python autograd wrapper, a redispatch below autograd): about 30 µs per forward and
# 200-300 µs per forward + backward of Python work on this project's CPU machine (docs/benchmarks.md),
# against a GPU time of 70 / 250 µs for the kernels at DiT-XL/2 256 px. Plain eager calls therefore run
# the backend directly (no grad) or through :class:`_EagerMHLA` (a lean autograd.Function): the same
# backend functions with the same arguments, so results and gradients are bit-identical to the op's
# (tests/test_ops.py). Everything that must see one opaque node (torch.compile, torch.export, jit
# tracing, dispatch modes such as fake tensors, FlopCounterMode or selective checkpointing, tensor
# subclasses) gets the op.

_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def _plain_eager_call(q: Tensor, k: Tensor, v: Tensor, mixing: Tensor) -> bool:
    """Whether this call may skip the registered op: eager, no torch-function or dispatch mode and no jit
    tracer active, plain tensors. ``is_compiling`` comes first: torch.compile never traces the rest."""
    if torch.compiler.is_compiling():
        return False
    if (torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack()
            or torch._C._get_tracing_state() is not None):
        return False
    plain = _PLAIN_TENSOR_TYPES
    return type(q) in plain and type(k) in plain and type(v) in plain and type(mixing) in plain


def _eager_mhla(q, k, v, grid: tuple, blocks: tuple, mixing, feature_map: str, normalize: bool, eps: float,
                backend: str) -> Tensor:
    """``out`` of the op's forward, with the op's autograd formula where a gradient is needed."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or mixing.requires_grad):
        return _EagerMHLA.apply(q, k, v, grid, blocks, mixing, feature_map, normalize, eps, backend)
    out, *_ = _backend_module(backend).forward(q, k, v, grid, blocks, mixing, feature_map, normalize, eps)
    return out


class _EagerMHLA(torch.autograd.Function):
    """The registered op's forward and autograd formula as one autograd.Function, arguments in the op's
    order: the backend's forward, the op's ``_setup_context`` (what it saves), the op's formula
    (``_gradients``) with the backend's backward called directly."""

    @staticmethod
    def forward(ctx, q, k, v, grid, blocks, mixing, feature_map, normalize, eps, backend):
        output = _backend_module(backend).forward(q, k, v, grid, blocks, mixing, feature_map, normalize, eps)
        _setup_context(ctx, (q, k, v, grid, blocks, mixing, feature_map, normalize, eps, backend), output)
        return output[0]

    @staticmethod
    def backward(ctx, grad_out):
        # create_graph=True: the backward op itself, so that a second backward fails as it does for the op
        run_backward = torch.ops.mhla_gen.mhla_backward if torch.is_grad_enabled() else _backend_backward
        return _gradients(ctx, grad_out, run_backward)


__all__ = [
    "BACKENDS",
    "FEATURE_MAPS",
    "Saved",
    "get_mhla_backend",
    "mhla_attention",
    "mhla_attention_autograd",
    "mhla_backend",
]
