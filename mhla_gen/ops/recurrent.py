"""Recurrent (token-by-token) causal MHLA decoding.

The state keeps the summaries of finished chunks and the running summary of the current chunk.
Entering chunk ``i`` mixes the finished chunks once, ``P_i = Σ_{j<i} W[i, j] S_j``; each token then
costs ``O(d·e)``: ``o_t = φ(q_t)ᵀ (P_i + W[i, i] R_t) / (φ(q_t)ᵀ (p_i + W[i, i] r_t) + eps)``, where
``R_t`` is the running sum ``Σ_{s∈i, s≤t} φ(k_s) v_sᵀ``. It equals ``mhla_attention(causal=True)``
token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import accumulation_dtype, cast_output
from .feature_maps import get_feature_map
from .layout import BlockLayout


@dataclass
class MHLADecodeState:
    """Decoding cache for one sequence batch. Tensors are in the accumulation dtype (fp32 for halves)."""

    finished_kv: torch.Tensor  # (B, H, M, d, e) summaries S_j of finished chunks (zeros until done)
    finished_k: torch.Tensor  # (B, H, M, d) normalisers z_j of finished chunks
    prefix_kv: torch.Tensor  # (B, H, d, e) Σ_{j<i} W[i, j] S_j for the current chunk i
    prefix_k: torch.Tensor  # (B, H, d)
    running_kv: torch.Tensor  # (B, H, d, e) running summary of the current chunk
    running_k: torch.Tensor  # (B, H, d)
    position: int = 0

    @classmethod
    def empty(cls, layout: BlockLayout, batch, heads, key_dim, value_dim, dtype=torch.float32, device=None):
        if layout.ndim != 1:
            raise ValueError(f"recurrent decoding needs a 1D layout, got grid {layout.grid}")
        acc = accumulation_dtype(dtype)
        zeros = lambda *shape: torch.zeros(*shape, dtype=acc, device=device)  # noqa: E731
        m = layout.num_blocks
        return cls(
            finished_kv=zeros(batch, heads, m, key_dim, value_dim),
            finished_k=zeros(batch, heads, m, key_dim),
            prefix_kv=zeros(batch, heads, key_dim, value_dim),
            prefix_k=zeros(batch, heads, key_dim),
            running_kv=zeros(batch, heads, key_dim, value_dim),
            running_k=zeros(batch, heads, key_dim),
        )


def mhla_decode_step(
    q, k, v, state: MHLADecodeState, layout: BlockLayout, mixing, feature_map="relu", normalize=True, eps=1e-6
):
    """One decoding step. ``q, k``: ``(B, H, d)``, ``v``: ``(B, H, e)`` (a length-1 token axis is accepted).

    Returns ``(B, H, e)`` in q's dtype and updates ``state`` in place.
    """
    squeeze = q.dim() == 4
    if squeeze:
        if q.shape[2] != 1:
            raise ValueError(f"decode one token at a time; got q with {q.shape[2]} tokens")
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    t = state.position
    if t >= layout.num_tokens:
        raise ValueError(f"position {t} is past the end of the layout {layout} ({layout.num_tokens} tokens)")
    phi = get_feature_map(feature_map)
    acc = state.running_kv.dtype
    w = mixing.to(acc)
    fq, fk, v_acc = phi(q.to(acc)), phi(k.to(acc)), v.to(acc)

    chunk = int(layout.block_index[t])
    lengths = layout.block_lengths
    chunk_start = int(lengths[:chunk].sum())
    if t == chunk_start:  # entering a new chunk: mix the finished ones once
        state.prefix_kv = torch.einsum("j,bhjde->bhde", w[chunk, :chunk], state.finished_kv[:, :, :chunk])
        state.prefix_k = torch.einsum("j,bhjd->bhd", w[chunk, :chunk], state.finished_k[:, :, :chunk])
        state.running_kv = torch.zeros_like(state.running_kv)
        state.running_k = torch.zeros_like(state.running_k)
    state.running_kv = state.running_kv + fk.unsqueeze(-1) * v_acc.unsqueeze(-2)
    state.running_k = state.running_k + fk

    kv = state.prefix_kv + w[chunk, chunk] * state.running_kv
    out = torch.einsum("bhd,bhde->bhe", fq, kv)
    if normalize:
        z = state.prefix_k + w[chunk, chunk] * state.running_k
        out = out / ((fq * z).sum(-1, keepdim=True) + eps)

    if t == chunk_start + int(lengths[chunk]) - 1:  # chunk finished
        state.finished_kv[:, :, chunk] = state.running_kv
        state.finished_k[:, :, chunk] = state.running_k
    state.position = t + 1
    out = cast_output(out, q.dtype)
    return out.unsqueeze(2) if squeeze else out
