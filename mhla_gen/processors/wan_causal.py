"""Block-causal (streaming) self-attention in Wan's MHLA processor: the pieces ``wan.py`` and ``grid.py`` use.

A Wan transformer installed with ``MHLAConfig.chunk_frames`` runs block-causal MHLA (``ops/streaming.py``,
``docs/streaming.md``) in two ways:

* **a whole video** (training, a full forward): the processor builds the :class:`BlockCausal` of this
  call's token grid (:func:`block_causal_for`) and runs ``block_causal_mhla`` (general mixing) or
  ``factorised_block_causal_mhla`` (factorised mixing);
* **one chunk** (streaming, ``mhla_gen.integration.streaming.stream_step``; the block-causal softmax layers of
  ``wan_softmax.py`` step a KV cache the same way): a :class:`StreamCall` hangs on
  ``transformer.rope`` for the duration of one forward. The rope hook (``grid.wan_rotary_with_grid``)
  gives the chunk the rotary angles of its absolute frames (``grid.rotary_at_frames``) and tags the
  rotary embedding with the call; each layer steps its own cache through :meth:`StreamCall.step` and
  leaves the new cache there.

Chunks are counted in latent frames; a streaming model has a temporal patch of 1 (every Wan2.1 / Wan2.2
transformer), so latent frames and token frames are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops.layout import layout_for
from ..ops.streaming import BlockCausal
from .grid import STREAM_ATTR, check_grid  # noqa: F401 (STREAM_ATTR: where a StreamCall hangs)


def check_stream_config(cfg, transformer_config: dict) -> None:
    """A Wan transformer (its ``config.json`` as a dict) can run ``cfg``'s block-causal attention: a
    temporal patch of 1. ValueError naming the setting otherwise. The self-attention layers that
    ``cfg.layers`` leaves out run block-causal softmax with a KV cache (``wan_softmax.py``)."""
    if cfg.chunk_frames is None:
        return
    patch_t = transformer_config["patch_size"][0]
    if patch_t != 1:
        raise ValueError(f"chunk_frames={cfg.chunk_frames}: block-causal attention needs a temporal patch of "
                         f"1 (latent frames = token frames); this model's patch_size is "
                         f"{list(transformer_config['patch_size'])}")


def has_mhla_layers(cfg) -> bool:
    """Whether ``cfg`` puts MHLA in some self-attention layer (``layers=[]``: none, softmax throughout)."""
    return cfg.layers is None or len(cfg.layers) > 0


def fixed_length(cfg) -> bool:
    """Whether a block-causal model streams one length only: MHLA layers with general mixing (their ``W``
    covers one video's blocks). Factorised MHLA and block-causal softmax stream any length."""
    return cfg.stream_mixing == "general" and has_mhla_layers(cfg)


def check_chunk_grid(cfg, grid: tuple[int, int, int]) -> None:
    """A whole video's token ``grid`` ``(F, H, W)`` fits ``cfg``'s chunks and, when some layer runs MHLA, its
    blocks (:func:`block_causal_for`); ValueError (one line, naming the values) otherwise. Without MHLA
    layers (``layers=[]``: block-causal softmax throughout) the blocks are not used and not checked."""
    if not has_mhla_layers(cfg):
        if grid[0] % cfg.chunk_frames:
            raise ValueError(f"chunk_frames={cfg.chunk_frames} does not divide the {grid[0]} latent frames "
                             f"of the token grid {tuple(grid)}")
        return
    block_causal_for(cfg, grid)


def block_causal_for(cfg, grid: tuple[int, int, int]) -> BlockCausal:
    """The :class:`BlockCausal` of a whole video's token ``grid`` ``(F, H, W)`` under ``cfg``.

    General mixing: ``cfg.blocks`` cut the whole video. Factorised: ``cfg.blocks`` cut one chunk, so the
    video is cut into ``(F / chunk_frames · bf, bh, bw)`` blocks. ValueError (one line, naming the values)
    when the chunks do not divide the frames, a time block crosses a chunk, or the blocks do not fit."""
    chunk = cfg.chunk_frames
    if grid[0] % chunk:
        raise ValueError(f"chunk_frames={chunk} does not divide the {grid[0]} latent frames of the token "
                         f"grid {tuple(grid)}")
    blocks = tuple(cfg.blocks)
    if cfg.stream_mixing == "factorised":
        blocks = (grid[0] // chunk * blocks[0], *blocks[1:])
    check_grid(tuple(grid), blocks)
    return BlockCausal(layout_for(tuple(grid), blocks), chunk)


@dataclass
class StreamCall:
    """One streamed chunk's forward: where the chunk starts and each layer's cache before and after it.

    Attributes:
        frame_offset: the latent frame of the chunk's first frame (its RoPE positions start there).
        caches: ``{layer index: cache}`` before this chunk (``ops/streaming_cache.py``).
        index: ``{processor: layer index}`` of the model's self-attention processors (MHLA and
            block-causal softmax).
        stepped: ``{layer index: cache}`` after this chunk, filled as the layers run.
    """

    frame_offset: int
    caches: dict
    index: dict
    stepped: dict = field(default_factory=dict)

    def step(self, processor, q, k, v, *mixing) -> torch.Tensor:
        """``processor``'s layer on this chunk: q, k ``(B, H, T, d)``, v ``(B, H, T, e)`` -> ``(B, H, T, e)``
        from its cache and ``mixing`` (MHLA: ``W`` or ``(W_s, γ)``; softmax: none); the layer's new cache
        is kept."""
        layer = self.index[processor]
        out, self.stepped[layer] = self.caches[layer].step(q, k, v, *mixing)
        return out
