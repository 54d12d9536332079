"""Fast MHLA: batched GEMMs over blocks (DESIGN §1).

Shapes: ``B`` batch, ``H`` heads, ``N`` tokens, ``M`` blocks, ``L`` = largest block, ``d`` key dim,
``e`` value dim. Everything runs in block-major order ``(B, H, M, L, ·)``:

    S_j  = φ(K_j)ᵀ V_j              (B, H, M, d, e)   one batched GEMM over all blocks
    S̃    = W @ S                    (B, H, M, d, e)   one mixing GEMM (W broadcast over B, H)
    num  = φ(Q_i) S̃_i               (B, H, M, L, e)   one batched GEMM
    den  = φ(Q_i) · (W @ z)_i       (B, H, M, L, 1)   z_j = Σ_{s∈j} φ(k_s)

Padded slots of uneven layouts hold φ(k) = 0 and so add nothing to S or z.

Two implementations compute the same thing:

* :class:`MHLAFunction` (the default for ``causal=False``): a hand-written backward. The normaliser
  rides along as a column of ones appended to v (``φ(K_j)ᵀ [V_j 1] = [S_j z_j]``, as SANA pads v), so
  forward and backward are three batched GEMMs each plus the mixing-weight gradient. It saves the
  output, the mixed summaries, the per-token denominators (and the unmixed summaries while they are
  no larger than ``v``) and rebuilds the block-major ``φ(q)``, ``φ(k)``, ``v`` from the inputs in
  backward (a copy is cheaper than keeping them). On even layouts φ, the normaliser division and φ'
  run inside the reordering copies (``out=`` on split views, see ``BlockLayout.token_split_view``),
  and the output and input gradients take the strides of the inputs (diffusers' heads-interleaved
  ``(B, N, H, d)`` memory: merging heads afterwards is a view). Net: fewer elementwise passes and less
  memory than autograd, and than plain linear attention at small M. When nothing needs a gradient
  (``torch.no_grad`` / ``torch.inference_mode``, or no input requires grad) the same forward runs
  outside the Function (:func:`_forward`): nothing is saved and eps goes into the denominators in place.
* :func:`mhla_attention_autograd`: the same forward written with differentiable torch ops only
  (also the causal path). Tests check both against the references in ``naive.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..layout import BlockLayout
from .checks import accumulation_dtype, cast_output, check_inputs
from .feature_maps import get_feature_map


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
        q, k: ``(B, H, N, d)``; v: ``(B, H, N, e)``; tokens in row-major grid order.
        layout: the block partition of the ``N`` tokens.
        mixing: ``(M, M)``; ``mixing[i, j]`` weights key block ``j``'s summary for query block ``i``.
        feature_map: ``"relu"``, ``"elu+1"`` or a callable.
        normalize: divide by ``φ(q)ᵀ z̃ + eps`` (False: numerator only, as the Wan release does).
        causal: 1D only; blocks are chunks and token ``t`` sees keys ``s <= t``.
    Returns:
        ``(B, H, N, e)`` in q's dtype. Summaries accumulate in fp32 for bf16/fp16 inputs.

    Under ``torch.autocast`` the op runs with autocast off: it already picks its own precision (fp32
    summaries for half inputs), and autocast would re-cast its GEMMs to half precision.
    """
    if torch.is_autocast_enabled(q.device.type):  # the context costs ~10 µs a call, so only when needed
        with torch.autocast(q.device.type, enabled=False):
            return _mhla_attention(q, k, v, layout, mixing, feature_map, normalize, causal, eps)
    return _mhla_attention(q, k, v, layout, mixing, feature_map, normalize, causal, eps)


def _mhla_attention(q, k, v, layout, mixing, feature_map, normalize, causal, eps) -> torch.Tensor:
    if causal:
        return mhla_attention_autograd(q, k, v, layout, mixing, feature_map, normalize, causal, eps)
    check_inputs(q, k, v, layout, mixing, causal)
    phi = get_feature_map(feature_map)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, mixing)):
        return MHLAFunction.apply(q, k, v, mixing, layout, phi, normalize, eps)
    return _forward(q, k, v, mixing, layout, phi, normalize, eps, for_backward=False)[0]  # nothing saved


# --------------------------------------------------------------------------------------------------
# fused path: custom autograd.Function


def _phi_blocks(x: torch.Tensor, layout: BlockLayout, phi, dtype) -> torch.Tensor:
    """φ(x) in block-major order ``(B, H, M, L, d)`` with exact zeros in padded slots (no autograd)."""
    if not layout.is_even:
        return layout.to_blocks(phi(x.to(dtype)))  # pad *after* φ, since φ(0) need not be 0 (elu+1)
    if phi is F.relu and x.dtype == dtype:  # ReLU fused into the reordering copy
        out = x.new_empty(*x.shape[:-2], layout.num_blocks, layout.max_block_len, x.shape[-1])
        torch.clamp_min(layout.token_split_view(x), 0, out=layout.block_split_view(out))
        return out
    xb = layout.copy_to_blocks(x, dtype)  # fresh buffer: φ may work in place
    return F.relu_(xb) if phi is F.relu else phi(xb)


def _fused_phi_vjp(x: torch.Tensor, layout: BlockLayout, phi, acc) -> bool:
    """Whether :func:`_phi_vjp_from_blocks` can run as one pass from ``x`` alone (no block-major φ(x))."""
    return phi is F.relu and layout.is_even and x.dtype == acc


def _phi_vjp_from_blocks(grad_blocks, x, layout: BlockLayout, phi, phi_blocks=None) -> torch.Tensor:
    """``φ'(x) · from_blocks(grad_blocks)`` in token order and x's dtype (``grad_blocks`` may be overwritten).

    ``phi_blocks``: block-major φ(x); ReLU's derivative is read off it when the one-pass form is
    unavailable (half precision, uneven layouts).
    """
    if _fused_phi_vjp(x, layout, phi, grad_blocks.dtype):  # φ' fused into the reordering copy
        out = torch.empty_like(x)  # x's strides (dense inputs), as the other gradients
        torch.ops.aten.threshold_backward.grad_input(
            layout.block_split_view(grad_blocks), layout.token_split_view(x), 0,
            grad_input=layout.token_split_view(out),
        )
        return out
    if phi is F.relu and phi_blocks is not None:  # relu' = [φ(x) > 0]; then one cast-and-reorder copy
        torch.ops.aten.threshold_backward.grad_input(grad_blocks, phi_blocks, 0, grad_input=grad_blocks)
        return layout.copy_from_blocks(grad_blocks, x.dtype)
    grad = layout.copy_from_blocks(grad_blocks)
    with torch.enable_grad():  # any φ: differentiate it with autograd
        leaf = x.detach().to(grad.dtype).requires_grad_()
        (out,) = torch.autograd.grad(phi(leaf), leaf, grad)
    return out.to(x.dtype)


def _values_blocks(v: torch.Tensor, layout: BlockLayout, dtype, ones_column: bool) -> torch.Tensor:
    """Block-major ``v`` ``(B, H, M, L, e)``, plus a column of ones ``(..., e + 1)`` when ``ones_column``.

    With the ones column, ``φ(K_j)ᵀ [V_j 1]`` holds ``S_j`` and ``z_j`` side by side, so one GEMM chain
    yields numerator and denominator together (as SANA's processor pads v). Padded slots of uneven
    layouts may hold ones: their ``φ(k)`` rows are zero.
    """
    e = v.shape[-1]
    if not ones_column:
        return layout.copy_to_blocks(v, dtype)
    vb = v.new_empty(*v.shape[:-2], layout.num_blocks, layout.max_block_len, e + 1, dtype=dtype)
    layout.copy_to_blocks(v, out=vb[..., :e])
    vb[..., e].fill_(1)
    return vb


def _divide_to_blocks(x, den, layout: BlockLayout, out) -> None:
    """``out = to_blocks(x) / den`` for token-order x ``(B, H, N, c)``, block-major den ``(B, H, M, L, 1)``;
    ``out`` a block-major ``(B, H, M, L, c)`` buffer (any strides)."""
    if layout.is_even:
        torch.div(layout.token_split_view(x), layout.block_split_view(den), out=layout.block_split_view(out))
    else:
        torch.div(layout.to_blocks(x.to(out.dtype)), den, out=out)


def _divide_from_blocks(num, den, layout: BlockLayout, out) -> torch.Tensor:
    """``out = from_blocks(num / den)`` (``den`` None: no division) in out's dtype; fp16 is clipped to its
    range first (as ``cast_output``)."""
    if layout.is_even and out.dtype != torch.float16:
        if den is None:
            return layout.copy_from_blocks(num, out=out)
        num_view, den_view = layout.block_split_view(num), layout.block_split_view(den)
        torch.div(num_view, den_view, out=layout.token_split_view(out))
        return out
    num = num / den if den is not None else num
    if out.dtype == torch.float16:
        num = num.clamp(-65504, 65504)
    return layout.copy_from_blocks(num, out=out)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1, keepdim=True)`` for ``(..., c)`` tensors, as one batched GEMV without temporaries.

    When a and b share dense strides (e.g. both heads-interleaved) the rows are walked in memory order,
    so the GEMV reads them in place; the result ``(..., 1)`` has the matching strides.
    """
    order = sorted(range(a.dim() - 1), key=a.stride, reverse=True)  # leading dims, outermost first
    a_mem, b_mem = a.permute(*order, -1), b.permute(*order, -1)
    if a.stride() != b.stride() or not a_mem.is_contiguous():
        a_mem, b_mem = a_mem.contiguous(), b_mem.contiguous()
    c = a.shape[-1]
    rows = torch.bmm(a_mem.view(-1, 1, c), b_mem.view(-1, c, 1)).view(*a_mem.shape[:-1], 1)
    return rows.permute(*sorted(range(a.dim() - 1), key=order.__getitem__), -1)


def _block_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for block-major ``(B, H, M, r, c) @ (B, H, M, c, s)``, as one bmm over ``B·H·M``.

    The leading dims are flattened as views (``torch.matmul`` spends a few µs more per call on its
    broadcasting logic, which adds up at small sizes); a and b may be transposed in their last two dims.
    """
    out = torch.bmm(a.flatten(0, 2), b.flatten(0, 2))
    return out.view(*a.shape[:3], *out.shape[1:])


def _mix(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ_j w[i, j] x[..., j, :, :]`` for x ``(B, H, M, *rest)``: one bmm with W broadcast over B·H.

    An explicit bmm: ``torch.matmul(w, x)`` may fold it into ``(xᵀ wᵀ)ᵀ``, which copies x and the
    result (two extra ``x``-sized buffers, as large as q itself once M·d >= N). ``out``: a contiguous
    x-shaped buffer to write into (not x itself).
    """
    b, h, m, *rest = x.shape
    flat = x.reshape(b * h, m, -1)
    if out is None:
        return torch.bmm(w.expand(b * h, m, m), flat).view(b, h, m, *rest)
    torch.bmm(w.expand(b * h, m, m), flat, out=out.view(b * h, m, -1))
    return out


def _mix_grad(grad_mixed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``∂/∂W`` of ``Σ <grad_mixed, W @ x>``: ``Σ_{b,h} grad_mixed @ xᵀ``, ``(M, M)``."""
    b, h, m = x.shape[:3]
    g, x = grad_mixed.reshape(b * h, m, -1), x.reshape(b * h, m, -1)
    return (g @ x.transpose(-1, -2)).sum(dim=0)  # bmm + small sum: no (M, B·H·d·e) transposed copies


def _forward(q, k, v, mixing, layout: BlockLayout, phi, normalize: bool, eps: float, for_backward: bool):
    """The forward GEMM chain; returns ``out`` and, for backward, ``Ŝᵀ``, ``(W Ŝ)ᵀ`` and the denominators.

    Summaries are kept transposed, ``Ŝᵀ = [V 1]ᵀ φ(K)`` ``(B, H, M, c, d)`` with ``c = e [+ 1]``, and the
    queries' product comes out transposed too, ``numᵀ = (W Ŝ)ᵀ φ(Q)ᵀ`` ``(B, H, M, c, L)`` (SANA's
    orientation): MKL runs these bmm's 20-25 % faster than the untransposed ones when ``c`` is odd, and
    the denominators are then a contiguous row per block instead of a strided column.
    ``for_backward=False`` (inference) adds eps to the denominators in place inside the result buffer;
    backward needs them on their own, so then they are a fresh ``(B, H, M, L, 1)`` tensor.
    """
    acc = accumulation_dtype(q.dtype)
    e = v.shape[-1]
    fq = _phi_blocks(q, layout, phi, acc)  # (B, H, M, L, d)
    fk = _phi_blocks(k, layout, phi, acc)
    vb = _values_blocks(v, layout, acc, ones_column=normalize)  # (B, H, M, L, c), fresh and contiguous
    summaries_t = _block_bmm(vb.transpose(-1, -2), fk)  # Ŝᵀ = [S z]ᵀ: (B, H, M, c, d)
    del fk
    mixed_t = _mix(mixing.to(acc), summaries_t)  # (W Ŝ)ᵀ = [S̃ z̃]ᵀ
    # numᵀ into v's dead buffer (same element count; bmm: matmul's out= would copy through a temp)
    num_t = vb.view(*vb.shape[:3], vb.shape[-1], vb.shape[-2])  # (B, H, M, c, L)
    torch.bmm(mixed_t.flatten(0, 2), fq.flatten(0, 2).transpose(1, 2), out=num_t.flatten(0, 2))
    del fq
    den = None
    if normalize:  # φ(q)ᵀ z̃ + eps, one row per block: (B, H, M, 1, L) seen as (B, H, M, L, 1)
        den_row = num_t[..., e:, :]
        den = (den_row + eps if for_backward else den_row.add_(eps)).transpose(-1, -2)
    num = num_t[..., :e, :].transpose(-1, -2)  # (B, H, M, L, e)
    # (B, H, N, e) with v's strides when dense: processors hand in heads-interleaved (B, N, H, e) memory,
    # so merging heads afterwards is a free view
    out = _divide_from_blocks(num, den, layout, torch.empty_like(v, dtype=q.dtype))
    return out, summaries_t, mixed_t, den


class MHLAFunction(torch.autograd.Function):
    """Non-causal MHLA with a memory-lean backward.

    ``MHLAFunction.apply(q, k, v, mixing, layout, phi, normalize, eps)``; ``phi`` a callable feature map.

    With ``normalize`` the values carry a column of ones (:func:`_values_blocks`), so ``S`` and ``z``
    travel together as ``Ŝ = φ(K)ᵀ [V 1]`` (kept transposed, ``(B, H, M, e + 1, d)``, see
    :func:`_forward`): forward is three batched GEMMs (summaries, mixing, queries) and the last row of
    the result is the denominator; in backward ``∂num`` and ``∂den`` sit side by side in one
    ``(..., e + 1)`` gradient, which the same three GEMMs carry back. The output (and each input
    gradient) takes the strides of v (of q, k, v).
    Saved for backward: the output, the mixed summaries ``(W Ŝ)ᵀ``, the ``(B, H, M, L, 1)`` denominators
    and ``Ŝᵀ`` while it is no larger than ``v`` (``M·d <= N``; else backward recomputes it for ∂W);
    ``φ(q)``, ``φ(k)`` and ``v`` are rebuilt in block-major order from the inputs.
    When backward rebuilds ``Ŝᵀ``, it writes ``∂Ŝᵀ`` into that buffer afterwards: summaries-sized
    tensors are the largest temporaries when blocks are smaller than the head dim (``L < d``, e.g. 4x
    ``v`` at 256 tokens in 16 blocks with d = 64), and on CPU glibc hands freed blocks of that size back
    to the kernel, so each fresh one costs a page fault per 4 KiB on its first write.
    """

    @staticmethod
    def forward(ctx, q, k, v, mixing, layout: BlockLayout, phi, normalize: bool, eps: float):
        out, summaries_t, mixed_t, den = _forward(q, k, v, mixing, layout, phi, normalize, eps, True)
        # Ŝ is only needed for ∂W: keep it while it is no larger than v (M·d <= N), else recompute it
        keep = summaries_t if layout.num_blocks * q.shape[-1] <= layout.num_tokens else None
        ctx.save_for_backward(q, k, v, mixing, keep, mixed_t, den, out)
        ctx.layout, ctx.phi, ctx.normalize = layout, phi, normalize
        return out

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiable (no double backward)
    def backward(ctx, grad_out):
        q, k, v, mixing, summaries_t, mixed_t, den, out = ctx.saved_tensors
        layout, phi, normalize = ctx.layout, ctx.phi, ctx.normalize
        acc = mixed_t.dtype
        e = v.shape[-1]
        w = mixing.to(acc)
        need_q, need_k, need_v, need_w = ctx.needs_input_grad[:4]

        # out = num / den  =>  ∂num = g / den,  ∂den = -(g · out) / den, side by side like [num den]
        g_num = grad_out.new_empty(*mixed_t.shape[:3], layout.max_block_len, mixed_t.shape[-2], dtype=acc)
        if normalize:
            _divide_to_blocks(grad_out, den, layout, out=g_num[..., :e])
            neg_row_dot = _row_dot(grad_out.to(acc), out.to(acc)).neg_()  # (B, H, N, 1), dense: cheap
            _divide_to_blocks(neg_row_dot, den, layout, out=g_num[..., e:])
        else:
            layout.copy_to_blocks(grad_out, out=g_num)
        # g_num: (B, H, M, L, c); the transposed summaries make every GEMM below a plain product

        fq = _phi_blocks(q, layout, phi, acc)  # (B, H, M, L, d)
        grad_q = grad_k = grad_v = grad_w = None
        if need_q:
            g_fq = _block_bmm(g_num, mixed_t)  # (B, H, M, L, d), the ∂den ⊗ z̃ term included
            grad_q = _phi_vjp_from_blocks(g_fq, q, layout, phi, phi_blocks=fq)
            del g_fq
        g_mixed_t = _block_bmm(g_num.transpose(-1, -2), fq)  # ∂(W Ŝ)ᵀ: (B, H, M, c, d)
        del fq, g_num
        fk = vb = spare = None
        if need_w:
            if summaries_t is None:  # not kept by forward: rebuild φ(k), v (reused below) and Ŝᵀ
                fk = _phi_blocks(k, layout, phi, acc)
                vb = _values_blocks(v, layout, acc, ones_column=normalize)
                summaries_t = spare = _block_bmm(vb.transpose(-1, -2), fk)  # ours: reused for ∂Ŝᵀ
            grad_w = _mix_grad(g_mixed_t, summaries_t).to(mixing.dtype)
            del summaries_t
        if need_k or need_v:
            # ∂Ŝᵀ: (B, H, M, c, d), into the rebuilt Ŝᵀ's buffer when there is one (see the class docstring)
            g_summaries_t = _mix(w.transpose(0, 1), g_mixed_t, out=spare)
            del spare, g_mixed_t
            if fk is None and need_k and not _fused_phi_vjp(k, layout, phi, acc):
                fk = _phi_blocks(k, layout, phi, acc)  # ReLU' read off φ(k); kept for ∂v
            if need_k:
                vb = _values_blocks(v, layout, acc, ones_column=normalize) if vb is None else vb
                g_fk = _block_bmm(vb, g_summaries_t)  # (B, H, M, L, d), ∂z via the ones column
                del vb
                grad_k = _phi_vjp_from_blocks(g_fk, k, layout, phi, phi_blocks=fk)
                del g_fk
            if need_v:
                fk = _phi_blocks(k, layout, phi, acc) if fk is None else fk
                g_vb = _block_bmm(fk, g_summaries_t[..., :e, :].transpose(-1, -2))  # (B, H, M, L, e)
                del fk, g_summaries_t  # before the output copy: lowers the peak by two (N·d)-sized buffers
                grad_v = layout.copy_from_blocks(g_vb, out=torch.empty_like(v))  # v's strides, as out
        return grad_q, grad_k, grad_v, grad_w, None, None, None, None


# --------------------------------------------------------------------------------------------------
# plain autograd path (and the causal form)


def _featurize_blocks(x: torch.Tensor, layout: BlockLayout, phi) -> torch.Tensor:
    """φ(x) in block-major order ``(B, H, M, L, d)`` with exact zeros in padded slots."""
    if layout.is_even:
        return phi(layout.to_blocks(x))  # no padding: permute first so only one copy is kept
    return layout.to_blocks(phi(x))  # pad *after* φ, since φ(0) need not be 0 (elu+1)


def mhla_attention_autograd(
    q, k, v, layout: BlockLayout, mixing, feature_map="relu", normalize=True, causal=False, eps=1e-6
) -> torch.Tensor:
    """:func:`mhla_attention` written with differentiable torch ops only (autograd backward)."""
    check_inputs(q, k, v, layout, mixing, causal)
    phi = get_feature_map(feature_map)
    acc = accumulation_dtype(q.dtype)
    w = mixing.to(acc)

    qb = _featurize_blocks(q.to(acc), layout, phi)  # (B, H, M, L, d)
    kb = _featurize_blocks(k.to(acc), layout, phi)  # (B, H, M, L, d)
    vb = layout.to_blocks(v.to(acc))  # (B, H, M, L, e)
    if causal:
        num, den = _causal_terms(qb, kb, vb, w)
    else:
        num, den = _parallel_terms(qb, kb, vb, w)
    out = num / (den + eps) if normalize else num
    return cast_output(layout.from_blocks(out), q.dtype)


def _parallel_terms(qb, kb, vb, w):
    summaries = kb.transpose(-1, -2) @ vb  # S_j: (B, H, M, d, e)
    num = qb @ _mix(w, summaries)  # (B, H, M, L, e)
    norms = kb.sum(dim=-2)  # z_j: (B, H, M, d)
    den = qb @ _mix(w, norms).unsqueeze(-1)  # (B, H, M, L, 1)
    return num, den


def _causal_terms(qb, kb, vb, w):
    """Chunkwise causal form (Appendix C): earlier chunks via the strictly-lower mix, own chunk exact."""
    lower = torch.tril(w, diagonal=-1)
    self_weight = torch.diagonal(w).view(-1, 1, 1)  # W[i, i]: (M, 1, 1)
    length = qb.shape[-2]
    causal_mask = torch.ones(length, length, dtype=torch.bool, device=qb.device).tril()
    # intra-chunk scores, padded slots sit at the end of a chunk so the local mask is exact
    scores = (qb @ kb.transpose(-1, -2)).masked_fill(~causal_mask, 0.0) * self_weight  # (B, H, M, L, L)
    summaries = kb.transpose(-1, -2) @ vb
    num = qb @ _mix(lower, summaries) + scores @ vb
    den = qb @ _mix(lower, kb.sum(dim=-2)).unsqueeze(-1) + scores.sum(dim=-1, keepdim=True)
    return num, den
