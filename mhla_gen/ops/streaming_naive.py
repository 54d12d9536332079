"""Plain references for block-causal MHLA (the test oracles of ``streaming.py`` / ``streaming_cache.py``) and
block-causal softmax (of ``kv_cache.py``).
Slow on purpose: dense ``N x N`` weights, built from token facts (frame, block) rather than from
:class:`~mhla_gen.ops.streaming.BlockCausal`. Run them in float64.
"""

from __future__ import annotations

import math

import torch

from .feature_maps import get_feature_map
from .layout import BlockLayout


def token_chunks(layout: BlockLayout, chunk_frames: int) -> torch.Tensor:
    """LongTensor ``(N,)``: the chunk of each token, ``frame // chunk_frames`` (axis 0 is time)."""
    frame = torch.arange(layout.num_tokens) // math.prod(layout.grid[1:])
    return frame // chunk_frames


def block_causal_dense(q, k, v, layout: BlockLayout, chunk_frames: int, mixing, feature_map="relu",
                       normalize=True, eps=1e-6) -> torch.Tensor:
    """``A[t, s] = W[b(t), b(s)] · φ(q_t)·φ(k_s)``, zero where ``chunk(s) > chunk(t)``; ``out = A v``
    (divided by ``Σ_s A[t, s] + eps`` with ``normalize``). mixing ``(M, M)`` or per head ``(H, M, M)``.
    q, k ``(B, H, N, d)``, v ``(B, H, N, e)`` -> ``(B, H, N, e)``."""
    phi = get_feature_map(feature_map)
    blocks = layout.block_index.to(q.device)
    w = mixing if mixing.dim() == 3 else mixing[None]  # (H or 1, M, M)
    block_mix = w.to(q.dtype)[:, blocks][:, :, blocks]  # (H or 1, N, N)
    chunk = token_chunks(layout, chunk_frames).to(q.device)
    visible = (chunk[None, :] <= chunk[:, None]).to(q.dtype)  # (N, N)
    weights = (phi(q) @ phi(k).transpose(-1, -2)) * block_mix * visible
    out = weights @ v
    if normalize:
        out = out / (weights.sum(dim=-1, keepdim=True) + eps)
    return out


def factorised_dense(layout: BlockLayout, chunk_frames: int, spatial_mixing, decay) -> torch.Tensor:
    """``W[h, i, j] = W_s[s(i), s(j)] · γ_h^(t(i) - t(j))`` for ``t(j) <= t(i)``, else 0: ``(H, M, M)``.
    ``t(i)``: the chunk of block i's tokens; ``s(i)``: block i's rank among its chunk's blocks by id."""
    chunk_of_token = token_chunks(layout, chunk_frames)
    blocks = layout.block_index
    t = torch.stack([chunk_of_token[blocks == i][0] for i in range(layout.num_blocks)])  # (M,)
    s = torch.stack([(t[:i] == t[i]).sum() for i in range(layout.num_blocks)])  # (M,)
    lag = t[:, None] - t[None, :]  # (M, M)
    powers = decay[:, None, None] ** lag.clamp_min(0).to(decay.dtype)  # (H, M, M)
    return spatial_mixing[s][:, s] * powers * (lag >= 0).to(decay.dtype)


def block_causal_softmax_dense(q, k, v, chunk_tokens: int) -> torch.Tensor:
    """Softmax attention with the explicit ``N x N`` mask ``chunk(s) <= chunk(t)`` (``chunk = token //
    chunk_tokens``), scale ``1 / sqrt(d)``. q, k ``(B, H, N, d)``, v ``(B, H, N, e)`` -> ``(B, H, N, e)``."""
    chunk = torch.arange(q.shape[2], device=q.device) // chunk_tokens
    visible = chunk[None, :] <= chunk[:, None]  # (N, N)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
