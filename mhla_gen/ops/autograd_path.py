"""MHLA in plain differentiable torch ops: the causal path (paper Appendix C) and callable feature maps.

:func:`mhla_attention` sends causal calls and callable φ here; no model uses them (the models run the
registered op, ``mhla.py``). The math is the operator's (``naive.py`` has it as loops and dense
matrices), written with views, GEMMs and ``torch.cat`` over the layout's sub-grids, so autograd derives
the backward and ``torch.compile`` traces it like any other model code. The recurrent decoder
(``recurrent.py``) matches the causal result token by token.
"""

from __future__ import annotations

import torch

from .checks import accumulation_dtype, autocast_off, cast_output, check_inputs, mix_blocks
from .feature_maps import get_feature_map
from .layout import BlockLayout


def mhla_attention_autograd(
    q, k, v, layout: BlockLayout, mixing, feature_map="relu", normalize=True, causal=False, eps=1e-6
) -> torch.Tensor:
    """:func:`mhla_attention` written with differentiable torch ops only (autograd backward).

    Args and returns as :func:`mhla_attention`: q, k ``(B, H, N, d)``, v ``(B, H, N, e)``, mixing
    ``(M, M)`` -> ``(B, H, N, e)`` in q's dtype. Sub-grid by sub-grid (``BlockLayout.to_blocks``):
    block-major ``(Mg, B, H, Lg, ·)`` tensors, summaries of all blocks stacked ``(M, B, H, d, e)`` in the
    layout's sub-grid block order, mixed with ``W`` in that order.
    """
    check_inputs(q, k, v, layout, mixing, causal)
    with autocast_off(q.device.type):
        return _autograd_path(q, k, v, layout, mixing, get_feature_map(feature_map), normalize, causal, eps)


def _autograd_path(q, k, v, layout: BlockLayout, mixing, phi, normalize, causal, eps) -> torch.Tensor:
    acc = accumulation_dtype(q.dtype)
    w = layout.mixing_in_block_order(mixing.to(acc))
    qb = [phi(x) for x in layout.to_blocks(q.to(acc))]  # per sub-grid (Mg, B, H, Lg, d)
    kb = [phi(x) for x in layout.to_blocks(k.to(acc))]
    vb = layout.to_blocks(v.to(acc))  # (Mg, B, H, Lg, e)
    summaries = torch.cat([kx.mT @ vx for kx, vx in zip(kb, vb)])  # S_j: (M, B, H, d, e)
    norms = torch.cat([kx.sum(dim=-2) for kx in kb])  # z_j: (M, B, H, d)
    if causal:  # 1D: sub-grid order is chunk order
        lower = torch.tril(w, diagonal=-1)
        summaries, norms = mix_blocks(lower, summaries), mix_blocks(lower, norms)
    else:
        summaries, norms = mix_blocks(w, summaries), mix_blocks(w, norms)
    parts = []
    for sub, qx, kx, vx in zip(layout.subgrids, qb, kb, vb):
        own = slice(sub.offset, sub.offset + sub.num_blocks)
        num = qx @ summaries[own]  # (Mg, B, H, Lg, e)
        den = qx @ norms[own].unsqueeze(-1)  # (Mg, B, H, Lg, 1)
        if causal:  # the chunk's own keys, exactly: intra-chunk scores up to the query, weighted W[i, i]
            scores = (qx @ kx.mT).tril() * torch.diagonal(w)[own].view(-1, 1, 1, 1, 1)  # (Mg, B, H, Lg, Lg)
            num, den = num + scores @ vx, den + scores.sum(dim=-1, keepdim=True)
        parts.append(num / (den + eps) if normalize else num)
    return cast_output(layout.from_blocks(parts), q.dtype)


__all__ = ["mhla_attention_autograd"]
