"""Block-causal softmax attention: a whole video, and chunk by chunk with a KV cache.

The softmax counterpart of ``streaming.py`` / ``streaming_cache.py`` (the baseline streaming video models
use, CausVid / Self-Forcing): tokens are grouped in chunks of ``chunk_tokens`` consecutive tokens (a chunk of
latent frames in row-major ``(f h w)`` order); a token attends with softmax to every token of its own chunk
(both ways) and of every earlier chunk::

    out = block_causal_softmax(q, k, v, chunk_tokens)              # a whole video, (B, H, N, d)

    cache = KVStreamCache.empty(batch, heads, key_dim, value_dim, chunk_tokens, dtype=q.dtype)
    for q_c, k_c, v_c in chunks:
        out_c, cache = cache.step(q_c, k_c, v_c)                   # (B, H, chunk_tokens, d)

Both run ``F.scaled_dot_product_attention`` of one chunk's queries on the keys and values up to that chunk's
end (no ``N x N`` mask: on a GPU the flash / memory-efficient kernels run unmasked), so rolling a video
through the cache computes the same attention as the whole-video pass (tested against the dense masked
float64 reference in ``streaming_naive.py``). The cache holds the keys (after RoPE) and values of every
past token in the model's dtype: its memory grows with the video, ``chunks · T · (d + e)`` per head
(``streaming_cache_bytes``' ``softmax_kv``). A step returns a new cache and never writes into the old one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def check_chunk_tokens(num_tokens: int, chunk_tokens: int) -> None:
    """ValueError naming both unless ``chunk_tokens`` (>= 1) divides ``num_tokens``."""
    if chunk_tokens < 1 or num_tokens % chunk_tokens:
        raise ValueError(f"block-causal softmax: chunks of {chunk_tokens} tokens do not tile a sequence of "
                         f"{num_tokens} tokens")


def block_causal_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         chunk_tokens: int) -> torch.Tensor:
    """Softmax attention in which chunk ``c``'s queries see the keys of chunks ``0..c``.

    Args:
        q, k: ``(B, H, N, d)``; v: ``(B, H, N, e)``; ``chunk_tokens`` divides ``N``.
    Returns:
        ``(B, H, N, e)`` in q's dtype (SDPA's scale ``1 / sqrt(d)``, as ``WanAttnProcessor``).
    """
    check_chunk_tokens(q.shape[2], chunk_tokens)
    outs = []
    for end in range(chunk_tokens, q.shape[2] + 1, chunk_tokens):  # one SDPA per chunk, its past unmasked
        outs.append(F.scaled_dot_product_attention(q[:, :, end - chunk_tokens : end], k[:, :, :end],
                                                   v[:, :, :end]))
    return torch.cat(outs, dim=2)


@dataclass(frozen=True, eq=False)
class KVStreamCache:
    """Keys and values of the chunks streamed so far, for one softmax self-attention layer.

    Attributes:
        batch, heads, key_dim, value_dim, chunk_tokens: the shapes it was made for.
        keys: ``(B, H, P, d)`` after RoPE; values: ``(B, H, P, e)``; ``P = chunks_done · chunk_tokens``.
    """

    batch: int
    heads: int
    key_dim: int
    value_dim: int
    chunk_tokens: int
    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, key_dim: int, value_dim: int, chunk_tokens: int,
              dtype: torch.dtype = torch.float32, device=None) -> KVStreamCache:
        """The cache before the first chunk (no tokens), for q, k, v of ``dtype``."""
        if min(batch, heads, key_dim, value_dim, chunk_tokens) < 1:
            raise ValueError(f"batch={batch}, heads={heads}, key_dim={key_dim}, value_dim={value_dim} and "
                             f"chunk_tokens={chunk_tokens} must be positive")
        keys = torch.empty(batch, heads, 0, key_dim, dtype=dtype, device=device)
        values = torch.empty(batch, heads, 0, value_dim, dtype=dtype, device=device)
        return cls(batch, heads, key_dim, value_dim, chunk_tokens, keys, values)

    @property
    def chunks_done(self) -> int:
        return self.keys.shape[2] // self.chunk_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held."""
        return self.keys.nbytes + self.values.nbytes

    def _check_chunk(self, q, k, v) -> None:
        """q, k, v of one chunk of the layer this cache was made for: ValueError naming what differs."""
        b, h, t = self.batch, self.heads, self.chunk_tokens
        want = {"q": (b, h, t, self.key_dim), "k": (b, h, t, self.key_dim), "v": (b, h, t, self.value_dim)}
        for name, x in (("q", q), ("k", k), ("v", v)):
            if tuple(x.shape) != want[name]:
                raise ValueError(f"KV cache made for {name} of shape {want[name]} (batch, heads, chunk "
                                 f"tokens, dim), got {tuple(x.shape)}")
            if x.dtype != self.keys.dtype:
                raise ValueError(f"KV cache holds {self.keys.dtype} keys and values, got {name} in {x.dtype}")

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, KVStreamCache]:
        """One chunk: its output ``(B, H, T, e)`` (its queries on every past key and its own) and the cache
        that also holds its keys and values (``self`` is not changed)."""
        self._check_chunk(q, k, v)
        keys, values = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values)
        return out, dataclasses.replace(self, keys=keys, values=values)


__all__ = ["KVStreamCache", "block_causal_softmax", "check_chunk_tokens"]
