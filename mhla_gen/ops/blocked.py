"""Non-causal MHLA in PyTorch, sub-grid by sub-grid: what the custom op runs on CPU (and on GPUs where
the Triton kernels do not apply). Read it beside ``naive.py`` (the same math as loops and dense matrices).

Shapes: ``B`` batch, ``H`` heads, ``N`` tokens, ``M`` blocks, ``d`` key dim, ``e`` value dim,
``c = e + 1`` with the normaliser (else ``e``). A sub-grid (``BlockLayout.chunks``: the sub-grids, large
ones cut into slabs of at most N / 4 tokens to bound the temporaries) holds ``Mg`` blocks of ``Lg`` tokens
each; its block-major tensors are ``(Mg, B, H, Lg, ·)``, blocks outermost, so the
summaries of all sub-grids stack into one ``(M, B, H, c, d)`` tensor and mixing is a single GEMM.

The values carry a column of ones, so ``[V_j 1]ᵀ φ(K_j) = [S_j z_j]ᵀ`` gives summary and normaliser in
one GEMM, and ``(W Ŝ)ᵀ φ(Q)ᵀ`` gives numerator and denominator rows together: the orientation of
diffusers' ``SanaLinearAttnProcessor2_0`` (with one block this computes exactly what it computes).

    forward                                         backward (G = [∂num ∂den] per token)
    Ŝᵀ_j = [V_j 1]ᵀ φ(K_j)       (c, d) per block   ∂φ(Q_i) = G_i (W Ŝ)ᵀ_i
    (W Ŝ)ᵀ = W @ Ŝᵀ               one GEMM           ∂(W Ŝ)ᵀ_i = G_iᵀ φ(Q_i)
    [num den]ᵀ_i = (W Ŝ)ᵀ_i φ(Q_i)ᵀ                  ∂W = ∂(W Ŝ)ᵀ · Ŝᵀ (summed over B, H, c, d)
    out = num / (den + eps)                          ∂Ŝᵀ = Wᵀ @ ∂(W Ŝ)ᵀ
                                                     ∂φ(K_j) = [V_j 1] ∂Ŝᵀ_j,  ∂V_j = φ(K_j) ∂S_jᵀ

Block-major copies are made in the accumulation dtype (fp32 for bf16/fp16 inputs), so every GEMM
accumulates in fp32; backward rebuilds them from the inputs instead of saving them.
"""

from __future__ import annotations

import torch

from ..layout import SubGrid, layout_for
from .checks import accumulation_dtype, autocast_off
from .feature_maps import FEATURE_MAPS_INPLACE, feature_map_vjp_


def _blocks(x, sub: SubGrid, grid, dtype, width=None, floor=None) -> torch.Tensor:
    """Fresh ``(Mg, B, H, Lg, width)`` buffer holding ``x``'s sub-grid tokens block-major in ``dtype``
    (one copy); columns past ``x.shape[-1]`` are left for the caller. ``floor``: the copy is
    ``max(x, floor)`` (``clamp_min`` writing block-major, for ``x`` already in ``dtype``)."""
    b, h, _, c = x.shape
    out = x.new_empty(sub.num_blocks, b, h, sub.block_len, width or c, dtype=dtype)
    dst = sub.block_split(out if width is None else out[..., :c])
    if floor is None:
        dst.copy_(sub.token_view(x, grid))
    else:
        torch.clamp_min(sub.token_view(x, grid), floor, out=dst)
    return out


def _features(x, sub: SubGrid, grid, feature_map: str, dtype) -> torch.Tensor:
    """``φ(x)`` block-major ``(Mg, B, H, Lg, d)``. ReLU maps fuse into the copy (one pass over ``x``
    instead of two; ``clamp_min`` writes only its input's dtype); the others copy, then apply φ in place."""
    if feature_map in ("relu", "relu+1e-6") and x.dtype == dtype:
        fx = _blocks(x, sub, grid, dtype, floor=0.0)
        return fx if feature_map == "relu" else fx.add_(1e-6)
    return FEATURE_MAPS_INPLACE[feature_map](_blocks(x, sub, grid, dtype))


def _features_and_inputs(x, sub: SubGrid, grid, feature_map: str, dtype):
    """``(φ(x), what φ's vjp reads)`` block-major. ReLU's derivative is read off its output (``φ(x) > 0``
    exactly when ``x > 0``), so it needs no second copy of ``x``."""
    fx = _features(x, sub, grid, feature_map, dtype)
    return fx, fx if feature_map == "relu" else _blocks(x, sub, grid, dtype)


def _values(v, sub: SubGrid, grid, dtype, normalize: bool) -> torch.Tensor:
    """Block-major ``[V 1]`` ``(Mg, B, H, Lg, c)`` (the ones column only with the normaliser)."""
    e = v.shape[-1]
    vb = _blocks(v, sub, grid, dtype, width=e + normalize)
    if normalize:
        vb[..., e].fill_(1.0)
    return vb


def _bmm(a: torch.Tensor, b: torch.Tensor, out=None) -> torch.Tensor:
    """``a @ b`` for ``(Mg, B, H, r, s) @ (Mg, B, H, s, t)`` as one bmm over ``Mg·B·H`` (either operand
    may be transposed in its last two dims)."""
    result = torch.bmm(a.flatten(0, 2), b.flatten(0, 2), out=None if out is None else out.flatten(0, 2))
    return result.view(*a.shape[:3], *result.shape[1:])


def _mix(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``Σ_j w[i, j] x[j]`` for ``x`` ``(M, ...)``: one GEMM."""
    return (w @ x.flatten(1)).view_as(x)


def _write_tokens(dst, sub: SubGrid, grid, num, den=None) -> None:
    """``dst``'s sub-grid tokens ``= num / den`` (or ``num``) from block-major ``(Mg, B, H, Lg, ·)``;
    fp16 is clipped to its range first, as diffusers' SANA processor does."""
    dst = sub.token_view(dst, grid)
    if dst.dtype == torch.float16:
        num = (num / den if den is not None else num).clamp(-65504, 65504)
        den = None
    if den is None:
        dst.copy_(sub.block_split(num))
    else:
        torch.div(sub.block_split(num), sub.block_split(den), out=dst)


def empty_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, e)`` in q's dtype on heads-interleaved memory ``(B, N, H, e)``, as the Triton kernels
    write it: merging heads, ``out.transpose(1, 2).flatten(2)``, is a contiguous view for the output
    projection, and each token's ``e`` values are written in one run. (Channels-first memory, as SANA's
    processor has, wrote runs as short as a block's last axis: 5-6 tokens at the Wan 480p grid, where
    the forward's division into it took 3x as long.)"""
    b, h, n, e = v.shape
    return q.new_empty(b, n, h, e).transpose(1, 2)


def forward(q, k, v, mixing, grid, blocks, feature_map: str, normalize: bool, eps: float):
    """MHLA forward. q, k ``(B, H, N, d)``, v ``(B, H, N, e)`` (any strides), mixing ``(M, M)``.

    Returns ``out`` ``(B, H, N, e)`` in q's dtype (heads-interleaved, :func:`empty_output`), the mixed
    summaries ``(W Ŝ)ᵀ`` ``(M, B, H, c, d)`` (sub-grid block order) and ``den`` ``(B, H, N)`` (with eps;
    empty without the normaliser) in the accumulation dtype: what backward needs.
    """
    layout = layout_for(tuple(grid), tuple(blocks))
    acc = accumulation_dtype(q.dtype)
    (b, h, n, e), d = v.shape, q.shape[-1]
    with autocast_off(q.device.type):
        summaries = q.new_empty(layout.num_blocks, b, h, e + normalize, d, dtype=acc)  # Ŝᵀ
        for sub in layout.chunks:
            fk = _features(k, sub, grid, feature_map, acc)  # (Mg, B, H, Lg, d)
            vb = _values(v, sub, grid, acc, normalize)  # (Mg, B, H, Lg, c)
            _bmm(vb.mT, fk, out=summaries[sub.offset : sub.offset + sub.num_blocks])
            del fk, vb
        mixed = _mix(layout.mixing_in_block_order(mixing.to(acc)), summaries)  # (W Ŝ)ᵀ: (M, B, H, c, d)
        del summaries

        out = empty_output(q, v)
        den = q.new_empty(b, h, n, dtype=acc) if normalize else q.new_empty(0, dtype=acc)
        for sub in layout.chunks:
            fq = _features(q, sub, grid, feature_map, acc)
            own = mixed[sub.offset : sub.offset + sub.num_blocks]
            num = _bmm(fq, own.mT)  # [num den]: (Mg, B, H, Lg, c)
            del fq
            if normalize:
                den_blocks = num[..., e:].add_(eps)  # (Mg, B, H, Lg, 1)
                _write_tokens(den.unsqueeze(-1), sub, grid, den_blocks)
                _write_tokens(out, sub, grid, num[..., :e], den_blocks)
            else:
                _write_tokens(out, sub, grid, num)
    return out, mixed, den


def _output_grad(grad_out, out, den, sub: SubGrid, grid, dtype) -> torch.Tensor:
    """``G = [g / den, -(g · out) / den]`` block-major ``(Mg, B, H, Lg, c)``: the gradient of
    ``[num den]`` from ``out = num / den`` (just ``g`` without the normaliser)."""
    e = grad_out.shape[-1]
    if den.numel() == 0:
        return _blocks(grad_out, sub, grid, dtype)
    g = grad_out.new_empty(sub.num_blocks, *grad_out.shape[:2], sub.block_len, e + 1, dtype=dtype)
    den_view = sub.token_view(den.unsqueeze(-1), grid)
    torch.div(sub.token_view(grad_out, grid), den_view, out=sub.block_split(g[..., :e]))
    g_num = sub.block_split(g[..., :e])  # g / den
    sub.block_split(g[..., e:]).copy_((g_num * sub.token_view(out, grid)).sum(-1, keepdim=True).neg_())
    return g


def _write_input_grad(dst, sub: SubGrid, grid, x_blocks, grad_blocks, feature_map: str) -> None:
    """``dst``'s sub-grid tokens ``= φ'(x) · grad`` (``grad_blocks`` is overwritten)."""
    _write_tokens(dst, sub, grid, feature_map_vjp_(feature_map, x_blocks, grad_blocks))


def backward(grad_out, q, k, v, mixing, out, mixed, den, grid, blocks, feature_map: str, normalize: bool,
             needs: tuple[bool, bool, bool, bool]):
    """Gradients ``(dq, dk, dv, dmixing)`` of :func:`forward` (None where ``needs`` is False)."""
    layout = layout_for(tuple(grid), tuple(blocks))
    acc = mixed.dtype
    e = v.shape[-1]
    need_q, need_k, need_v, need_w = needs
    with autocast_off(q.device.type):
        w = layout.mixing_in_block_order(mixing.to(acc))
        grad_q = torch.empty_like(q) if need_q else None
        grad_mixed = torch.empty_like(mixed)  # ∂(W Ŝ)ᵀ: (M, B, H, c, d)
        for sub in layout.chunks:  # queries: ∂q and ∂(W Ŝ)ᵀ
            g = _output_grad(grad_out, out, den, sub, grid, acc)  # (Mg, B, H, Lg, c)
            fq, xq = _features_and_inputs(q, sub, grid, feature_map, acc)
            blocks_of_sub = slice(sub.offset, sub.offset + sub.num_blocks)
            if need_q:
                grad_fq = _bmm(g, mixed[blocks_of_sub])  # (Mg, B, H, Lg, d)
                _write_input_grad(grad_q, sub, grid, xq, grad_fq, feature_map)
            _bmm(g.mT, fq, out=grad_mixed[blocks_of_sub])
            del g, xq, fq

        grad_k = torch.empty_like(k) if need_k else None
        grad_v = torch.empty_like(v) if need_v else None
        grad_w = torch.empty_like(w) if need_w else None  # the sub-grids' columns cover it
        grad_summaries = _mix(w.T, grad_mixed) if need_k or need_v else None  # ∂Ŝᵀ
        for sub in layout.chunks:  # keys and values: ∂k, ∂v and ∂W
            blocks_of_sub = slice(sub.offset, sub.offset + sub.num_blocks)
            fk, xk = _features_and_inputs(k, sub, grid, feature_map, acc)
            vb = _values(v, sub, grid, acc, normalize)
            if need_w:  # ∂W[:, j] = <∂(W Ŝ)ᵀ, Ŝᵀ_j> over (B, H, c, d)
                summaries = _bmm(vb.mT, fk)  # Ŝᵀ of this sub-grid's blocks
                grad_w[:, blocks_of_sub] = grad_mixed.flatten(1) @ summaries.flatten(1).T
                del summaries
            if need_k:
                grad_fk = _bmm(vb, grad_summaries[blocks_of_sub])  # (Mg, B, H, Lg, d), ∂z via the ones
                _write_input_grad(grad_k, sub, grid, xk, grad_fk, feature_map)
            if need_v:
                grad_vb = _bmm(fk, grad_summaries[blocks_of_sub, ..., :e, :].mT)  # (Mg, B, H, Lg, e)
                _write_tokens(grad_v, sub, grid, grad_vb)
            del xk, fk, vb
        if need_w:
            grad_w = layout.mixing_from_block_order(grad_w).to(mixing.dtype)
    return grad_q, grad_k, grad_v, grad_w
