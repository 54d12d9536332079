"""Streaming a block-causal MHLA Wan transformer chunk by chunk: its memory and one chunk's forward.

A Wan transformer installed with ``MHLAConfig.chunk_frames`` (``docs/streaming.md``) makes a video
``chunk_frames`` latent frames at a time. :class:`WanStreamCache` is the memory of the chunks made so far:
one cache per self-attention layer (MHLA layers: ``GeneralStreamCache`` or ``FactorisedStreamCache``,
``ops/streaming_cache.py``; block-causal softmax layers: ``KVStreamCache``, ``ops/kv_cache.py``), the latent
frames done, and what it was made for. :func:`stream_step` runs
the transformer on the next chunk and returns its output with the cache that includes that chunk::

    cache = WanStreamCache.empty(transformer, batch=1, latent_size=(60, 104))       # frames=F: general
    out, after = stream_step(transformer, cache, chunk, timestep, text)            # chunk (B, C, cf, h, w)
    # a denoising step uses `out` and keeps `cache`; once the chunk is clean, run it again (at t = 0,
    # as CausVid / Self-Forcing do) and keep `after`: the next chunk attends to the clean chunk

Rolling a video through :func:`stream_step` equals one forward of the whole video with each chunk's
timestep (a ``(B, N)`` per-token timestep; tested): the same function, computed one chunk at a time. Each
chunk's RoPE angles are those of its absolute frames (``processors/wan_causal.py``), so a streamed video
may be longer than the model's rotary table. The factorised cache is the same size after any number of
chunks; the general one grows by a chunk's block summaries each step and ends with the video it was made
for (its ``W`` is ``M x M`` over that video's blocks).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..ops.kv_cache import KVStreamCache
from ..ops.streaming_cache import FactorisedStreamCache, GeneralStreamCache
from ..processors.config import MHLAConfig
from ..processors.grid import STREAM_ATTR
from ..processors.wan import WanMHLAProcessor
from ..processors.wan_causal import StreamCall, block_causal_for, check_chunk_grid, fixed_length
from ..processors.wan_softmax import WanBlockCausalSoftmaxProcessor
from .install import is_mhla_installed


def check_streaming_model(transformer: nn.Module) -> MHLAConfig:
    """The MHLA config of a block-causal Wan transformer; ValueError (one line) for anything else."""
    if not isinstance(transformer, WanMHLAProcessor.model_cls):
        raise ValueError(f"streaming is built for WanTransformer3DModel, got a {type(transformer).__name__}")
    cfg = transformer.mhla_config if is_mhla_installed(transformer) else None
    if cfg is None or cfg.chunk_frames is None:
        what = "stock attention" if cfg is None else f"bidirectional MHLA (blocks {list(cfg.blocks)})"
        raise ValueError(f"this transformer runs {what}: streaming needs a block-causal model, installed "
                         f"with chunk_frames (fine-tune one with mhla.chunk_frames=..., docs/streaming.md)")
    return cfg


def _stream_layers(transformer: nn.Module) -> dict[int, nn.Module]:
    """``{layer index: attention module}`` of the self-attention layers that keep a stream cache: MHLA
    layers and block-causal softmax layers (every layer of a block-causal model)."""
    layers = WanMHLAProcessor.self_attention(transformer)
    streaming = (WanMHLAProcessor, WanBlockCausalSoftmaxProcessor)
    return {i: attn for i, attn in enumerate(layers) if isinstance(attn.processor, streaming)}


@dataclass(frozen=True, eq=False)
class WanStreamCache:
    """The memory of a streamed video: one cache per self-attention layer, and what it was made for.

    Attributes:
        model: a weak reference to the transformer it belongs to (its layers' summaries mean nothing to
            another model, even one of the same shape).
        mhla: that model's MHLA config when the cache was made.
        batch: videos streamed together.
        latent_size: ``(h, w)`` of every chunk's latents.
        frames: the video's latent frames (general mixing: its ``W`` fixes them); None: no end (factorised).
        frames_done: latent frames streamed so far (where the next chunk's RoPE positions start).
        layers: ``{layer index: GeneralStreamCache | FactorisedStreamCache | KVStreamCache}``.
    """

    model: weakref.ref
    mhla: MHLAConfig
    batch: int
    latent_size: tuple[int, int]
    frames: int | None
    frames_done: int
    layers: dict

    @classmethod
    def empty(cls, transformer: nn.Module, batch: int, latent_size: tuple[int, int],
              frames: int | None = None) -> WanStreamCache:
        """The memory before the first chunk of ``batch`` videos of ``latent_size`` ``(h, w)`` latent pixels.

        Args:
            frames: the video's latent frames: required by the general mixing (its ``W`` covers one video's
                blocks; checked here), optional for the factorised one and for block-causal softmax
                (None: any length).
        Raises:
            ValueError: not a block-causal Wan model, or a size the blocks or chunks do not fit.
        """
        cfg = check_streaming_model(transformer)
        _, ph, pw = transformer.config.patch_size
        chunk_grid = (cfg.chunk_frames, latent_size[0] // ph, latent_size[1] // pw)
        if batch < 1 or min(chunk_grid[1:]) < 1:
            raise ValueError(f"batch={batch} and latent_size={tuple(latent_size)} must be positive (a "
                             f"{chunk_grid} token grid per chunk)")
        if frames is not None and frames < 1:  # else refused only at the first step (softmax, factorised)
            raise ValueError(f"frames={frames}: a streamed video has at least one latent frame "
                             "(None: any length)")
        if frames is None and fixed_length(cfg):
            raise ValueError(f"stream_mixing=general: its W covers the blocks {list(cfg.blocks)} of one "
                             f"video, so the cache needs that video's latent frames (frames=...)")
        grid = (frames if frames is not None else cfg.chunk_frames, *chunk_grid[1:])
        check_chunk_grid(cfg, grid)  # ValueError when chunks or blocks do not fit
        layers = {i: _layer_cache(cfg, grid, attn, batch) for i, attn in _stream_layers(transformer).items()}
        return cls(weakref.ref(transformer), cfg, batch, tuple(latent_size), frames, 0, layers)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's cache tensors."""
        return sum(cache.nbytes for cache in self.layers.values())

    def check_model(self, transformer: nn.Module) -> None:
        """ValueError unless this cache was made for ``transformer`` and its MHLA is unchanged."""
        if self.model() is not transformer:
            raise ValueError("this stream cache was made for another model (a cache holds one model's "
                             "summaries): start one with WanStreamCache.empty(transformer, ...)")
        if transformer.mhla_config != self.mhla:
            raise ValueError(f"this stream cache was made for MHLA {self.mhla.to_dict()}, the model now runs "
                             f"{transformer.mhla_config.to_dict()}")

    def check_chunk(self, latent: torch.Tensor) -> None:
        """``latent`` is the next chunk of this stream: ValueError naming the shape or the end."""
        cfg, (h, w) = self.mhla, self.latent_size
        if latent.dim() != 5 or (latent.shape[0], *latent.shape[2:]) != (self.batch, cfg.chunk_frames, h, w):
            raise ValueError(f"a chunk of this stream is (batch={self.batch}, channels, chunk_frames="
                             f"{cfg.chunk_frames}, {h}, {w}) latents, got {tuple(latent.shape)}")
        if self.frames is not None and self.frames_done + cfg.chunk_frames > self.frames:
            raise ValueError(f"this stream cache holds all {self.frames} latent frames of the video it was "
                             f"made for (general mixing ends there)")


def _layer_cache(cfg: MHLAConfig, grid: tuple[int, int, int], attn: nn.Module, batch: int):
    """One layer's empty cache, for q, k, v of its projections' dtype (MHLA states in its accumulation
    dtype; a softmax layer's KV cache in that dtype)."""
    weight = attn.to_q.weight
    head_dim = attn.inner_dim // attn.heads
    args = (batch, attn.heads, head_dim, head_dim)
    if isinstance(attn.processor, WanBlockCausalSoftmaxProcessor):
        chunk_tokens = cfg.chunk_frames * grid[1] * grid[2]
        return KVStreamCache.empty(*args, chunk_tokens, dtype=weight.dtype, device=weight.device)
    causal = block_causal_for(cfg, grid)
    options = dict(feature_map=cfg.feature_map, normalize=cfg.normalize, eps=cfg.eps, dtype=weight.dtype,
                   device=weight.device)
    if cfg.stream_mixing == "factorised":
        return FactorisedStreamCache.empty(causal, *args, **options)
    return GeneralStreamCache.empty(causal, *args, **options)


def stream_step(transformer: nn.Module, cache: WanStreamCache, hidden_states: torch.Tensor,
                timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                **kwargs) -> tuple[torch.Tensor, WanStreamCache]:
    """The transformer on the next chunk of a stream.

    Args:
        transformer: the block-causal Wan transformer ``cache`` was made for.
        cache: the stream so far (not changed).
        hidden_states: the chunk's latents ``(B, C, chunk_frames, h, w)``.
        timestep, encoder_hidden_states, kwargs: as ``WanTransformer3DModel.forward`` takes them.
    Returns:
        ``(output (B, C, chunk_frames, h, w), the cache with this chunk)``.
    Raises:
        ValueError: before any work, for a bidirectional model, a cache of another model, a chunk of
            another shape, or a chunk past the end of a general cache's video.
    """
    check_streaming_model(transformer)
    cache.check_model(transformer)
    cache.check_chunk(hidden_states)
    index = {attn.processor: i for i, attn in _stream_layers(transformer).items()}
    call = StreamCall(cache.frames_done, cache.layers, index)
    setattr(transformer.rope, STREAM_ATTR, call)
    try:
        out = transformer(hidden_states=hidden_states, timestep=timestep,
                          encoder_hidden_states=encoder_hidden_states, return_dict=False, **kwargs)[0]
    finally:
        delattr(transformer.rope, STREAM_ATTR)
    missing = sorted(set(cache.layers) - set(call.stepped))
    if missing:
        raise RuntimeError(f"self-attention layers {missing} did not step their stream cache (processors "
                           f"replaced behind install_mhla's back?)")
    frames_done = cache.frames_done + cache.mhla.chunk_frames
    return out, dataclasses.replace(cache, layers=call.stepped, frames_done=frames_done)


__all__ = ["WanStreamCache", "check_streaming_model", "stream_step"]
