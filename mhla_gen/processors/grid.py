"""How the token grid reaches the attention processors.

SANA and Wan blocks call self-attention without height/width/frames (DESIGN §4), so a forward
pre-hook on the transformer (``mhla_gen.install``) reads the latent shape and patch size before every
forward and stores the token grid in a :class:`GridContext` shared by all MHLA processors of that
transformer.
"""

from __future__ import annotations

import torch

from ..layout import BlockLayout


class GridContext:
    """Token grid of the current forward, plus a cache of block layouts per grid."""

    def __init__(self, blocks: tuple[int, ...]):
        self.blocks = tuple(blocks)
        self.grid: tuple[int, ...] | None = None
        self._layouts: dict[tuple[int, ...], BlockLayout] = {}

    def set_grid(self, grid: tuple[int, ...]) -> None:
        grid = tuple(int(g) for g in grid)
        if len(grid) != len(self.blocks):
            raise ValueError(f"token grid {grid} and MHLA blocks {self.blocks} have different ranks")
        for axis, (g, b) in enumerate(zip(grid, self.blocks)):
            if b > g:
                raise ValueError(
                    f"MHLA blocks {self.blocks} do not fit the token grid {grid}: axis {axis} has {g} tokens "
                    f"but {b} blocks; use fewer blocks or a larger resolution"
                )
        self.grid = grid

    def layout(self, num_tokens: int) -> BlockLayout:
        if self.grid is None:
            raise ValueError(
                "MHLA processor called before the token grid was set (was install_mhla used?)"
            )
        if self.grid not in self._layouts:
            self._layouts[self.grid] = BlockLayout(self.grid, self.blocks)
        layout = self._layouts[self.grid]
        layout.check_tokens(num_tokens, "self-attention sequence length")
        return layout


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
