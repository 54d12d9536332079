"""How each MHLA layer learns its token grid: from its own call, never from "the last forward".

A layer's block layout is fixed by the call that runs it, so a gradient-checkpointed recompute (which
re-runs the same calls with the same arguments) uses the grid of its own forward, even when the model
ran other forwards at other grids in between (mixed aspect-ratio buckets):

* DiT: the self-attention input ``(B, N, C)`` of a square token grid (DiT's own unpatchify supports
  square grids only), or ``(B, C, H, W)``.
* SANA: every ``SanaTransformerBlock`` is called with ``height`` and ``width``; a forward pre-hook on the
  block hands them to its self-attention processor right before the block runs (and again when a
  checkpointed block is recomputed).
* Wan: every block receives the rotary embedding computed from this forward's latent; a forward hook
  on ``transformer.rope`` returns it as a :class:`GridRotaryEmb`, a 2-tuple ``(cos, sin)`` (what the
  stock processors unpack) that also carries the token grid.

A forward pre-hook on the transformer (``check_latent``) validates the latent against the MHLA blocks
before any work, with a message naming both.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed

ROPE_THETA = 10000.0  # WanRotaryPosEmbed's default; WanTransformer3DModel never passes another
STREAM_ATTR = "mhla_stream_call"
"""The attribute of ``transformer.rope`` holding the ``StreamCall`` of a streamed chunk's forward
(``processors/wan_causal.py``); absent otherwise."""


class GridRotaryEmb(tuple):
    """Wan's ``(freqs_cos, freqs_sin)`` plus the token grid ``(F, H, W)`` of the latent they encode, and, in
    a streamed chunk's forward, its :class:`~mhla_gen.processors.wan_causal.StreamCall` (``stream``; None
    otherwise)."""

    def __new__(cls, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, grid: tuple[int, int, int],
                stream=None):
        self = super().__new__(cls, (freqs_cos, freqs_sin))
        self.grid = grid
        self.stream = stream
        return self

    def to(self, *args, **kwargs) -> GridRotaryEmb:
        """Both tensors ``.to(...)``, grid kept. accelerate's ``send_to_device`` (its offload hooks,
        diffusers' group offloading) calls ``.to`` where it exists; otherwise it rebuilds a tuple as
        ``type(obj)(generator)``, which would drop the grid."""
        return GridRotaryEmb(self[0].to(*args, **kwargs), self[1].to(*args, **kwargs), self.grid, self.stream)


def latent_from_call(args: tuple, kwargs: dict) -> torch.Tensor:
    """The ``hidden_states`` argument of a diffusers transformer forward (positional or keyword)."""
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    if args:
        return args[0]
    raise ValueError("transformer called without hidden_states")


def image_token_grid(transformer, latent: torch.Tensor) -> tuple[int, int]:
    """``(H / p, W / p)`` for an image latent ``(B, C, H, W)``, floored as the patch embedding of DiT and
    SANA does (``transformer.config.patch_size`` = p)."""
    if latent.dim() != 4:
        raise ValueError(
            f"{type(transformer).__name__} latents must be (batch, channels, height, width), "
            f"got {tuple(latent.shape)}"
        )
    p = transformer.config.patch_size
    return latent.shape[-2] // p, latent.shape[-1] // p


def check_grid(grid: tuple[int, ...], blocks: tuple[int, ...]) -> None:
    """``ValueError`` naming both when the MHLA blocks cannot tile the token grid."""
    if len(grid) != len(blocks):
        raise ValueError(f"token grid {grid} and MHLA blocks {blocks} have different ranks")
    for axis, (g, b) in enumerate(zip(grid, blocks)):
        if b > g:
            raise ValueError(
                f"MHLA blocks {blocks} do not fit the token grid {grid}: axis {axis} has {g} tokens "
                f"but {b} blocks; use fewer blocks or a larger resolution"
            )


def square_token_grid(num_tokens: int) -> tuple[int, int]:
    """DiT's ``(n, n)`` grid of ``n * n`` tokens (its unpatchify takes ``n = int(N ** 0.5)`` too)."""
    side = int(num_tokens**0.5 + 0.5)
    if side * side != num_tokens:
        raise ValueError(f"DiT supports square token grids only; got {num_tokens} tokens")
    return side, side


def sana_block_grid(block, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on a ``SanaTransformerBlock``: its ``height`` / ``width`` arguments (positions
    5 and 6, or keywords) become the token grid of its MHLA self-attention for this call."""
    height = kwargs["height"] if "height" in kwargs else args[5]
    width = kwargs["width"] if "width" in kwargs else args[6]
    block.attn1.processor.token_grid = (height, width)


def clear_block_grid(block, args: tuple, output) -> None:
    """Forward hook on a ``SanaTransformerBlock``: the grid is valid during the block's call only."""
    block.attn1.processor.token_grid = None


def wan_rotary_with_grid(rope, args: tuple, output) -> GridRotaryEmb:
    """Forward hook on ``WanTransformer3DModel.rope``: tag the rotary embedding with the token grid of
    the latent it was computed from (``rope``'s input ``(B, C, F, H, W)``, patch size ``rope.patch_size``).
    In a streamed chunk's forward (a ``StreamCall`` on ``rope``, ``processors/wan_causal.py``) the angles
    are those of the chunk's absolute frames, and the call rides along."""
    frames, height, width = args[0].shape[-3:]
    p_t, p_h, p_w = rope.patch_size
    grid = (frames // p_t, height // p_h, width // p_w)
    stream = getattr(rope, STREAM_ATTR, None)
    if stream is not None:
        output = rotary_at_frames(rope, output, grid, stream.frame_offset)
    return GridRotaryEmb(*output, grid=grid, stream=stream)


def rotary_at_frames(rope, freqs: tuple[torch.Tensor, torch.Tensor], grid: tuple[int, int, int],
                     offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's rotary tables ``(cos, sin)``, each ``(1, N, 1, d)`` for a latent at frames ``0..F-1`` (what
    ``WanRotaryPosEmbed`` returns), moved to frames ``offset..offset+F-1``.

    Only the time part (the first ``rope.t_dim`` channels) depends on the frame; it is recomputed with
    ``WanRotaryPosEmbed``'s own function and arguments, which give the same numbers as its table row by
    row, so a chunk at ``offset`` gets exactly the rows the whole video's forward gives those frames, and
    frames past the table (``rope_max_seq_len``) work too."""
    frames = grid[0]
    positions = torch.arange(offset, offset + frames, dtype=torch.float64)
    dtype = torch.float32 if torch.backends.mps.is_available() else torch.float64  # as WanRotaryPosEmbed
    time_parts = get_1d_rotary_pos_embed(rope.t_dim, positions, ROPE_THETA, use_real=True,
                                         repeat_interleave_real=True, freqs_dtype=dtype)  # 2 x (F, t_dim)
    moved = []
    for table, time in zip(freqs, time_parts):
        per_frame = table.unflatten(1, (frames, -1))  # (1, F, H*W, 1, d)
        time = time.to(table)[None, :, None, None, :].expand(1, frames, per_frame.shape[2], 1, -1)
        moved.append(torch.cat([time, per_frame[..., rope.t_dim :]], dim=-1).flatten(1, 2))
    return moved[0], moved[1]
