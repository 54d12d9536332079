"""The two memories of streaming block-causal MHLA, and what they cost next to a softmax KV cache.

A streaming generator makes chunk ``c`` from its own tokens and a cache of chunks ``0..c-1``; each chunk's
tokens attend both ways inside the chunk plus the cache. Rolling a whole video through a cache chunk by
chunk gives exactly the full-sequence block-causal pass (``streaming.py``)::

    cache = GeneralStreamCache.empty(causal, batch, heads, key_dim, value_dim)
    for c in range(causal.num_chunks):
        out_c, cache = cache.step(q_c, k_c, v_c, mixing)            # q_c: (B, H, chunk_tokens, d)

    cache = FactorisedStreamCache.empty(chunk_layout, batch, heads, key_dim, value_dim)
    while generating:
        out_c, cache = cache.step(q_c, k_c, v_c, spatial_mixing, decay)

A step returns a new cache and never writes into the old one (a rollout can be differentiated, and a cache
can be reused, e.g. to regenerate a chunk at the next denoising step). Per chunk the work is the chunk's
summaries and read-out, ``O(T d c)`` for ``T`` chunk tokens, plus the mixing over blocks:
``O(m · M_past · d c)`` for the general cache, ``O(m² d c)`` for the factorised one; no token-by-token
score. States are in the accumulation dtype (fp32 for half inputs).

* :class:`GeneralStreamCache`: every past block's summary ``[S_j z_j]``; memory grows with the video.
* :class:`FactorisedStreamCache`: one running state per block of a chunk, ``R_s <- γ_h R_s + S_s``; memory
  constant in the video's length. With one block per chunk it is the single global state that
  SANA-Video-style block-causal linear attention keeps.

:func:`streaming_cache_bytes` computes both sizes and a softmax KV cache's for the same model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .checks import accumulation_dtype, autocast_off, cast_output
from .feature_maps import get_feature_map
from .layout import BlockLayout
from .streaming import (
    BlockCausal,
    block_summaries,
    check_decay,
    check_spatial_mixing,
    mix,
    read_states,
)


@dataclass(frozen=True, eq=False)
class _StreamCache:
    """What both caches record and check: the model's attention shape and settings.

    Attributes:
        chunk_layout: the layout of the next chunk (its tokens in row-major ``(f h w)`` order).
        batch, heads, key_dim, value_dim: the shapes the cache was made for.
        feature_map, normalize, eps: the attention's settings (the states depend on them).
        chunks_done: chunks stepped so far.
    """

    chunk_layout: BlockLayout
    batch: int
    heads: int
    key_dim: int
    value_dim: int
    feature_map: object
    normalize: bool
    eps: float
    chunks_done: int

    @property
    def width(self) -> int:
        """``c``: columns of a state (``e`` values plus the normaliser)."""
        return self.value_dim + self.normalize

    def _check_chunk(self, q, k, v, states: torch.Tensor) -> None:
        """q, k, v of one chunk of the model this cache was made for: ValueError naming what differs."""
        tokens = self.chunk_layout.num_tokens
        want = {"q": (self.batch, self.heads, tokens, self.key_dim), "k": (self.batch, self.heads, tokens,
                self.key_dim), "v": (self.batch, self.heads, tokens, self.value_dim)}
        for name, t in (("q", q), ("k", k), ("v", v)):
            if tuple(t.shape) != want[name]:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, but this cache was made for chunks of shape "
                    f"{want[name]} (batch, heads, tokens of a {self.chunk_layout.grid} chunk, dim)"
                )
        if accumulation_dtype(q.dtype) != states.dtype:
            raise ValueError(f"this cache holds {states.dtype} states; q is {q.dtype} (states are made in "
                             f"{accumulation_dtype(q.dtype)} for it)")

    def _phi(self):
        return get_feature_map(self.feature_map)

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's tensors."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class GeneralStreamCache(_StreamCache):
    """The general mixing's memory: the summary of every block of the chunks done, ``(M_done, B, H, d, c)``
    in block order. ``causal`` fixes the video (``W`` is ``(M, M)`` over all its blocks)."""

    causal: BlockCausal = None
    summaries: torch.Tensor = None

    @classmethod
    def empty(cls, causal: BlockCausal, batch: int, heads: int, key_dim: int, value_dim: int, *,
              feature_map="relu", normalize: bool = True, eps: float = 1e-6, dtype=torch.float32,
              device=None) -> GeneralStreamCache:
        """A cache before the first chunk, for inputs of ``dtype`` (states in its accumulation dtype)."""
        if not isinstance(causal, BlockCausal):
            raise ValueError(f"causal must be a BlockCausal, got {type(causal).__name__}")
        get_feature_map(feature_map)
        summaries = torch.zeros(0, batch, heads, key_dim, value_dim + normalize,
                                dtype=accumulation_dtype(dtype), device=device)
        return cls(causal.chunk_layout(0), batch, heads, key_dim, value_dim, feature_map, normalize, eps, 0,
                   causal, summaries)

    def _tensors(self):
        return [self.summaries]

    def check_model(self, causal: BlockCausal) -> None:
        """ValueError unless this cache was made for ``causal``."""
        if causal != self.causal:
            raise ValueError(f"this cache was made for {self.causal}, not {causal}")

    def step(self, q, k, v, mixing) -> tuple[torch.Tensor, GeneralStreamCache]:
        """The next chunk: q, k ``(B, H, T, d)``, v ``(B, H, T, e)`` for its ``T`` tokens, mixing ``(M, M)``
        (the whole video's; entries of later chunks are never read). Returns ``(out (B, H, T, e) in q's
        dtype, the cache with this chunk's summaries appended)``."""
        causal, chunk = self.causal, self.chunks_done
        if chunk >= causal.num_chunks:
            raise ValueError(f"this cache has stepped all {causal.num_chunks} chunks of {causal}")
        self._check_chunk(q, k, v, self.summaries)
        m = causal.layout.num_blocks
        if mixing.shape != (m, m):
            raise ValueError(f"mixing must have shape ({m}, {m}) for {causal}, got {tuple(mixing.shape)}")
        blocks, acc, phi = causal.chunk_blocks(chunk), self.summaries.dtype, self._phi()
        with autocast_off(q.device.type):
            own = block_summaries(k.to(acc), v.to(acc), self.chunk_layout, phi, self.normalize)  # (m_c, ...)
            summaries = torch.cat([self.summaries, own])  # (M_done + m_c, B, H, d, c)
            mixed = mix(mixing[blocks.start : blocks.stop, : blocks.stop].to(acc), summaries)  # (m_c, ...)
            out = read_states(q.to(acc), mixed, self.chunk_layout, phi, self.normalize, self.eps)
        following = causal.chunk_layout(min(chunk + 1, causal.num_chunks - 1))
        cache = dataclasses.replace(self, summaries=summaries, chunks_done=chunk + 1, chunk_layout=following)
        return cast_output(out, q.dtype), cache


@dataclass(frozen=True, eq=False)
class FactorisedStreamCache(_StreamCache):
    """The factorised mixing's memory: ``R_s = Σ_{c' <= c} γ_h^(c - c') S_{c', s}`` per block ``s`` of a
    chunk, ``(m, B, H, d, c)``. The same size after any number of chunks; no end of video."""

    state: torch.Tensor = None

    @classmethod
    def empty(cls, chunk_layout: BlockLayout | BlockCausal, batch: int, heads: int, key_dim: int,
              value_dim: int, *, feature_map="relu", normalize: bool = True, eps: float = 1e-6,
              dtype=torch.float32, device=None) -> FactorisedStreamCache:
        """A cache before the first chunk. ``chunk_layout``: one chunk's layout, or a uniform
        :class:`BlockCausal` (its chunk layout)."""
        if isinstance(chunk_layout, BlockCausal):
            chunk_layout.blocks_per_chunk  # noqa: B018 - ValueError for a non-uniform one
            chunk_layout = chunk_layout.chunk_layout(0)
        if not isinstance(chunk_layout, BlockLayout):
            raise ValueError(
                f"chunk_layout must be a BlockLayout or BlockCausal, got {type(chunk_layout).__name__}"
            )
        get_feature_map(feature_map)
        state = torch.zeros(chunk_layout.num_blocks, batch, heads, key_dim, value_dim + normalize,
                            dtype=accumulation_dtype(dtype), device=device)
        return cls(chunk_layout, batch, heads, key_dim, value_dim, feature_map, normalize, eps, 0, state)

    def _tensors(self):
        return [self.state]

    def check_model(self, causal: BlockCausal) -> None:
        """ValueError unless ``causal``'s chunks are this cache's chunk layout."""
        causal.blocks_per_chunk  # noqa: B018 - ValueError for a non-uniform one
        if causal.chunk_layout(0) != self.chunk_layout:
            raise ValueError(f"this cache was made for chunks {self.chunk_layout}, not those of {causal}")

    def step(self, q, k, v, spatial_mixing, decay) -> tuple[torch.Tensor, FactorisedStreamCache]:
        """The next chunk: q, k ``(B, H, T, d)``, v ``(B, H, T, e)``, ``W_s`` ``(m, m)``, ``γ`` ``(H,)`` in
        (0, 1]. Returns ``(out (B, H, T, e) in q's dtype, the cache with R <- γ R + S)``."""
        self._check_chunk(q, k, v, self.state)
        check_spatial_mixing(spatial_mixing, self.chunk_layout.num_blocks)
        check_decay(decay, self.heads)
        acc, phi = self.state.dtype, self._phi()
        with autocast_off(q.device.type):
            own = block_summaries(k.to(acc), v.to(acc), self.chunk_layout, phi, self.normalize)  # (m, ...)
            state = decay.to(acc).view(1, 1, -1, 1, 1) * self.state + own  # R <- γ R + S
            out = read_states(q.to(acc), mix(spatial_mixing.to(acc), state), self.chunk_layout, phi,
                              self.normalize, self.eps)
        cache = dataclasses.replace(self, state=state, chunks_done=self.chunks_done + 1)
        return cast_output(out, q.dtype), cache


def streaming_cache_bytes(chunk_layout: BlockLayout, chunks: int, batch: int, heads: int, key_dim: int,
                          value_dim: int, *, normalize: bool = True, dtype=torch.bfloat16,
                          layers: int = 1) -> dict[str, int]:
    """Bytes each memory holds after ``chunks`` chunks of ``chunk_layout`` (per model: ``layers`` attention
    layers), for a model run in ``dtype``:

    * ``softmax_kv``: keys and values of every past token, ``chunks · T · (d + e)`` per head, in ``dtype``;
    * ``general``: ``[S_j z_j]`` of every past block, ``chunks · m · d · c`` per head;
    * ``factorised``: one state per block of a chunk, ``m · d · c`` per head, whatever ``chunks`` is;

    the MHLA states in the accumulation dtype (fp32 for half models), ``c = e + 1`` with the normaliser.
    These are the sizes of :class:`GeneralStreamCache` / :class:`FactorisedStreamCache` (their ``nbytes``).
    """
    if chunks < 0:
        raise ValueError(f"chunks must be >= 0, got {chunks}")
    per_head = layers * batch * heads
    tokens, blocks, width = chunk_layout.num_tokens, chunk_layout.num_blocks, value_dim + normalize
    state = accumulation_dtype(dtype).itemsize
    return {
        "softmax_kv": per_head * chunks * tokens * (key_dim + value_dim) * dtype.itemsize,
        "general": per_head * chunks * blocks * key_dim * width * state,
        "factorised": per_head * blocks * key_dim * width * state,
    }


__all__ = ["FactorisedStreamCache", "GeneralStreamCache", "streaming_cache_bytes"]
