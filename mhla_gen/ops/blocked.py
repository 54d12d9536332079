"""Non-causal MHLA in PyTorch, sub-grid by sub-grid: the registered op's ``"pytorch"`` backend (``mhla.py``
has the contract), what it runs on CPU and wherever the Triton kernels do not apply or are switched off.
Read it beside ``naive.py`` (the same math as loops and dense matrices).

Shapes: ``B`` batch, ``H`` heads, ``N`` tokens, ``M`` blocks, ``d`` key dim, ``e`` value dim,
``c = e + 1`` with the normaliser (else ``e``). A sub-grid (``BlockLayout.chunks``: the sub-grids, large
ones cut into slabs of at most N / 4 tokens to bound the temporaries) holds ``Mg`` blocks of ``Lg`` tokens
each; its block-major tensors are ``(Mg·B·H, Lg, ·)`` (blocks outermost, then batch and heads: what
``torch.bmm`` takes), so the summaries of all sub-grids stack into one ``(M·B·H, c, d)`` tensor and mixing
is a single GEMM on its ``(M, B·H·c·d)`` view.

The values carry a column of ones, so ``[V_j 1]ᵀ φ(K_j) = [S_j z_j]ᵀ`` gives summary and normaliser in
one GEMM, and ``(W Ŝ)ᵀ φ(Q)ᵀ`` gives numerator and denominator rows together: the orientation of
diffusers' ``SanaLinearAttnProcessor2_0`` (with one block this computes exactly what it computes).

    forward                                         backward (G = [∂num ∂den] per token)
    Ŝᵀ_j = [V_j 1]ᵀ φ(K_j)       (c, d) per block   Ŝᵀ or (W Ŝ)ᵀ again (the one not saved)
    (W Ŝ)ᵀ = W @ Ŝᵀ               one GEMM           ∂φ(Q_i) = G_i (W Ŝ)ᵀ_i
    [num den]ᵀ_i = (W Ŝ)ᵀ_i φ(Q_i)ᵀ                  ∂(W Ŝ)ᵀ_i = G_iᵀ φ(Q_i)
    out = num / (den + eps)                          ∂W = ∂(W Ŝ)ᵀ · Ŝᵀ (summed over B, H, c, d)
                                                     ∂Ŝᵀ = Wᵀ @ ∂(W Ŝ)ᵀ
                                                     ∂φ(K_j) = [V_j 1] ∂Ŝᵀ_j,  ∂V_j = φ(K_j) ∂S_jᵀ

Block-major copies are made in the accumulation dtype (fp32 for bf16/fp16 inputs), so every GEMM
accumulates in fp32; backward rebuilds them from the inputs instead of saving them. Backward needs both
Ŝᵀ (for ∂W) and (W Ŝ)ᵀ; the forward saves one and backward redoes the other, whichever is cheaper
(:func:`saves_summaries`): the mixing GEMM costs ``2 M² c d`` flops per head, the summaries ``2 N c d``.
"""

from __future__ import annotations

import math

import torch

from .checks import accumulation_dtype, autocast_off, mix_blocks
from .feature_maps import FEATURE_MAPS_INPLACE, feature_map_vjp_
from .layout import SubGrid, layout_for


def backward_reads_out(state) -> bool:
    """The backward reads ``out`` for G·o whatever the forward saved (``mhla.Saved``)."""
    return True


def _rows(sub: SubGrid, bh: int) -> slice:
    """The sub-grid's rows of a stacked ``(M·B·H, ·, ·)`` tensor (``bh = B·H`` rows per block)."""
    return slice(sub.offset * bh, (sub.offset + sub.num_blocks) * bh)


def _blocks(x, sub: SubGrid, grid, dtype, width=None, floor=None) -> torch.Tensor:
    """Fresh ``(Mg·B·H, Lg, width)`` buffer holding ``x``'s sub-grid tokens block-major in ``dtype``
    (one copy); columns past ``x.shape[-1]`` are left for the caller. ``floor``: the copy is
    ``max(x, floor)`` (``clamp_min`` writing block-major, for ``x`` already in ``dtype``)."""
    b, h, _, c = x.shape
    out = x.new_empty(sub.num_blocks * b * h, sub.block_len, width or c, dtype=dtype)
    dst = sub.block_split(out if width is None else out[..., :c], b, h)
    if floor is None:
        dst.copy_(sub.token_view(x, grid))
    else:
        torch.clamp_min(sub.token_view(x, grid), floor, out=dst)
    return out


def _features(x, sub: SubGrid, grid, feature_map: str, dtype) -> torch.Tensor:
    """``φ(x)`` block-major ``(Mg·B·H, Lg, d)``. ReLU maps fuse into the copy (one pass over ``x``
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
    """Block-major ``[V 1]`` ``(Mg·B·H, Lg, c)`` (the ones column only with the normaliser)."""
    e = v.shape[-1]
    vb = _blocks(v, sub, grid, dtype, width=e + normalize)
    if normalize:
        vb[..., e].fill_(1.0)
    return vb


def _write_tokens(dst, sub: SubGrid, grid, num, den=None) -> None:
    """``dst``'s sub-grid tokens ``= num / den`` (or ``num``) from block-major ``(Mg·B·H, Lg, ·)``;
    fp16 is clipped to its range first, as diffusers' SANA processor does."""
    b, h = dst.shape[:2]
    dst = sub.token_view(dst, grid)
    if dst.dtype == torch.float16:
        num = (num / den if den is not None else num).clamp(-65504, 65504)
        den = None
    if den is None:
        dst.copy_(sub.block_split(num, b, h))
    else:
        torch.div(sub.block_split(num, b, h), sub.block_split(den, b, h), out=dst)


def empty_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, e)`` in q's dtype on heads-interleaved memory ``(B, N, H, e)``, as the Triton kernels
    write it: merging heads, ``out.transpose(1, 2).flatten(2)``, is a contiguous view for the output
    projection, and each token's ``e`` values are written in one run (channels-first memory, as SANA's
    processor has, would split the writes of a block into runs as short as the block's last axis)."""
    b, h, n, e = v.shape
    return q.new_empty(b, n, h, e).transpose(1, 2)


def saves_summaries(layout) -> bool:
    """Whether the forward saves the summaries ``Ŝᵀ`` (backward redoes the mixing: ``M² <= N``, e.g. 16
    blocks from 256 tokens, Wan's 150 blocks of 32,760 tokens) or the mixed ``(W Ŝ)ᵀ`` (backward
    rebuilds the summaries from k and v: many small blocks, e.g. 256 blocks of 1024 tokens)."""
    return layout.num_blocks**2 <= layout.num_tokens


def forward_outputs_like(q: torch.Tensor, v: torch.Tensor, blocks, normalize: bool):
    """Empty ``(out, state, norm, den)`` with the shapes, dtypes and strides :func:`forward` returns (the
    op's fake implementation)."""
    (b, h, n, e), d = v.shape, q.shape[-1]
    acc = accumulation_dtype(q.dtype)
    state = q.new_empty(math.prod(blocks), b, h, e + normalize, d, dtype=acc)
    den = q.new_empty(b, h, n, dtype=acc) if normalize else q.new_empty(0, dtype=acc)
    return empty_output(q, v), state, q.new_empty(0, dtype=acc), den


def forward(q, k, v, grid, blocks, mixing, feature_map: str, normalize: bool, eps: float):
    """MHLA forward. q, k ``(B, H, N, d)``, v ``(B, H, N, e)`` (any strides), mixing ``(M, M)``.

    Returns ``(out, state, norm, den)`` (the op's contract, ``mhla.Saved``): ``out`` ``(B, H, N, e)`` in
    q's dtype (heads-interleaved, :func:`empty_output`); ``state`` ``Ŝᵀ`` or ``(W Ŝ)ᵀ``
    (:func:`saves_summaries`) ``(M, B, H, c, d)`` in sub-grid block order; ``norm`` empty (the normaliser
    is row ``e`` of ``state``); ``den`` ``(B, H, N)`` (with eps; empty without the normaliser); all but
    ``out`` in the accumulation dtype.
    """
    layout = layout_for(tuple(grid), tuple(blocks))
    acc = accumulation_dtype(q.dtype)
    (b, h, n, e), d = v.shape, q.shape[-1]
    bh = b * h
    with autocast_off(q.device.type):
        summaries = q.new_empty(layout.num_blocks * bh, e + normalize, d, dtype=acc)  # Ŝᵀ: (M·B·H, c, d)
        for sub in layout.chunks:
            fk = _features(k, sub, grid, feature_map, acc)  # (Mg·B·H, Lg, d)
            vb = _values(v, sub, grid, acc, normalize)  # (Mg·B·H, Lg, c)
            torch.bmm(vb.mT, fk, out=summaries[_rows(sub, bh)])
            del fk, vb
        mixed = mix_blocks(layout.mixing_in_block_order(mixing.to(acc)), summaries)  # (W Ŝ)ᵀ: (M·B·H, c, d)
        saved = summaries if saves_summaries(layout) else mixed
        del summaries

        out = empty_output(q, v)
        den = q.new_empty(b, h, n, dtype=acc) if normalize else q.new_empty(0, dtype=acc)
        for sub in layout.chunks:
            fq = _features(q, sub, grid, feature_map, acc)
            num = torch.bmm(fq, mixed[_rows(sub, bh)].mT)  # [num den]: (Mg·B·H, Lg, c)
            del fq
            if normalize:
                den_blocks = num[..., e:].add_(eps)  # (Mg·B·H, Lg, 1)
                _write_tokens(den.unsqueeze(-1), sub, grid, den_blocks)
                _write_tokens(out, sub, grid, num[..., :e], den_blocks)
            else:
                _write_tokens(out, sub, grid, num)
    return out, saved.view(layout.num_blocks, b, h, e + normalize, d), q.new_empty(0, dtype=acc), den


def _output_grad(grad_out, out, den, sub: SubGrid, grid, dtype) -> torch.Tensor:
    """``G = [g / den, -(g · out) / den]`` block-major ``(Mg·B·H, Lg, c)``: the gradient of
    ``[num den]`` from ``out = num / den`` (just ``g`` without the normaliser)."""
    if den.numel() == 0:
        return _blocks(grad_out, sub, grid, dtype)
    b, h, _, e = grad_out.shape
    g = grad_out.new_empty(sub.num_blocks * b * h, sub.block_len, e + 1, dtype=dtype)
    g_num = sub.block_split(g[..., :e], b, h)
    torch.div(sub.token_view(grad_out, grid), sub.token_view(den.unsqueeze(-1), grid), out=g_num)  # g / den
    sub.block_split(g[..., e:], b, h).copy_((g_num * sub.token_view(out, grid)).sum(-1, keepdim=True).neg_())
    return g


def _write_input_grad(dst, sub: SubGrid, grid, x_blocks, grad_blocks, feature_map: str) -> None:
    """``dst``'s sub-grid tokens ``= φ'(x) · grad`` (``grad_blocks`` is overwritten)."""
    _write_tokens(dst, sub, grid, feature_map_vjp_(feature_map, x_blocks, grad_blocks))


def backward(grad_out, q, k, v, grid, blocks, mixing, feature_map: str, normalize: bool, eps: float, out,
             state, norm, den, needs):
    """Gradients ``(dq, dk, dv, dmixing)`` of :func:`forward` (None where ``needs`` is False), in the
    inputs' strides. ``out, state, norm, den``: what the forward returned (``state`` is ``Ŝᵀ`` or
    ``(W Ŝ)ᵀ``, :func:`saves_summaries`; ``norm`` is unused, eps is already in ``den``)."""
    layout = layout_for(tuple(grid), tuple(blocks))
    acc, e, m, bh = state.dtype, v.shape[-1], layout.num_blocks, q.shape[0] * q.shape[1]
    saved = state.flatten(0, 2)  # (M·B·H, c, d)
    need_q, need_k, need_v, need_w = needs
    with autocast_off(q.device.type):
        w = layout.mixing_in_block_order(mixing.to(acc))
        summaries = saved if saves_summaries(layout) else None  # else rebuilt below for ∂W
        mixed = mix_blocks(w, saved) if summaries is not None else saved  # (W Ŝ)ᵀ: (M·B·H, c, d)
        grad_q, grad_mixed = _query_grads(grad_out, q, out, den, mixed, grid, layout, feature_map, need_q)
        del mixed

        rebuild = need_w and summaries is None  # ∂W from Ŝᵀ rebuilt sub-grid by sub-grid below
        grad_w = None  # ∂W[i, j] = <∂(W Ŝ)ᵀ_i, Ŝᵀ_j> over (B, H, c, d)
        if need_w:
            grad_w = torch.empty_like(w) if rebuild else grad_mixed.view(m, -1) @ summaries.view(m, -1).T
        grad_summaries = mix_blocks(w.T, grad_mixed) if need_k or need_v else None  # ∂Ŝᵀ: (M·B·H, c, d)
        grad_mixed = grad_mixed if rebuild else None
        grad_k = torch.empty_like(k) if need_k else None
        grad_v = torch.empty_like(v) if need_v else None
        for sub in layout.chunks if need_k or need_v or rebuild else ():  # keys and values
            rows = _rows(sub, bh)
            fk, xk = _features_and_inputs(k, sub, grid, feature_map, acc)  # (Mg·B·H, Lg, d)
            vb = _values(v, sub, grid, acc, normalize)  # (Mg·B·H, Lg, c)
            if rebuild:  # ∂W[:, j] for this sub-grid's blocks j, from their Ŝᵀ
                sub_summaries = torch.bmm(vb.mT, fk).view(sub.num_blocks, -1)
                columns = slice(sub.offset, sub.offset + sub.num_blocks)
                grad_w[:, columns] = grad_mixed.view(m, -1) @ sub_summaries.T
            if need_k:
                grad_fk = torch.bmm(vb, grad_summaries[rows])  # (Mg·B·H, Lg, d), ∂z via the ones
                _write_input_grad(grad_k, sub, grid, xk, grad_fk, feature_map)
            if need_v:
                grad_vb = torch.bmm(fk, grad_summaries[rows, :e, :].mT)  # (Mg·B·H, Lg, e)
                _write_tokens(grad_v, sub, grid, grad_vb)
            del xk, fk, vb
        if need_w:
            grad_w = layout.mixing_from_block_order(grad_w).to(mixing.dtype)
    return grad_q, grad_k, grad_v, grad_w


def backward_outputs_like(q, k, v, mixing, needs):
    """Empty gradients (None where not needed) shaped, typed and strided as :func:`backward` returns them:
    ``torch.empty_like`` of each input."""
    return tuple(torch.empty_like(x) if need else None for x, need in zip((q, k, v, mixing), needs))


def _query_grads(grad_out, q, out, den, mixed, grid, layout, feature_map: str, need_q: bool):
    """``(∂q or None, ∂(W Ŝ)ᵀ (M·B·H, c, d))``, sub-grid by sub-grid over the queries."""
    acc, bh = mixed.dtype, q.shape[0] * q.shape[1]
    grad_q = torch.empty_like(q) if need_q else None
    grad_mixed = torch.empty_like(mixed)
    for sub in layout.chunks:
        g = _output_grad(grad_out, out, den, sub, grid, acc)  # (Mg·B·H, Lg, c)
        fq, xq = _features_and_inputs(q, sub, grid, feature_map, acc)
        if need_q:
            grad_fq = torch.bmm(g, mixed[_rows(sub, bh)])  # (Mg·B·H, Lg, d)
            _write_input_grad(grad_q, sub, grid, xq, grad_fq, feature_map)
        torch.bmm(g.mT, fq, out=grad_mixed[_rows(sub, bh)])
        del g, xq, fq
    return grad_q, grad_mixed
