"""Fast MHLA: batched GEMMs over blocks (DESIGN §1).

Shapes: ``B`` batch, ``H`` heads, ``N`` tokens, ``M`` blocks, ``L`` = largest block, ``d`` key dim,
``e`` value dim. Everything runs in block-major order ``(B, H, M, L, ·)``:

    S_j  = φ(K_j)ᵀ V_j              (B, H, M, d, e)   one batched GEMM over all blocks
    S̃    = W @ S                    (B, H, M, d, e)   one mixing GEMM (W broadcast over B, H)
    num  = φ(Q_i) S̃_i               (B, H, M, L, e)   one batched GEMM
    den  = φ(Q_i) · (W @ z)_i       (B, H, M, L, 1)   z_j = Σ_{s∈j} φ(k_s)

Padded slots of uneven layouts hold φ(k) = 0 and so add nothing to S or z. Autograd flows through q,
k, v and the mixing matrix. The plain references live in ``naive.py``.
"""

from __future__ import annotations

import torch

from ..layout import BlockLayout
from .checks import accumulation_dtype, cast_output, check_inputs
from .feature_maps import get_feature_map


def _featurize_blocks(x: torch.Tensor, layout: BlockLayout, phi) -> torch.Tensor:
    """φ(x) in block-major order ``(B, H, M, L, d)`` with exact zeros in padded slots."""
    if layout.is_even:
        return phi(layout.to_blocks(x))  # no padding: permute first so only one copy is kept
    return layout.to_blocks(phi(x))  # pad *after* φ, since φ(0) need not be 0 (elu+1)


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
    """
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


def _mix(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``Σ_j w[i, j] x[..., j, :, :]`` for x ``(B, H, M, *rest)``: one GEMM with W broadcast."""
    b, h, m, *rest = x.shape
    return torch.matmul(w, x.reshape(b, h, m, -1)).reshape(b, h, m, *rest)


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
