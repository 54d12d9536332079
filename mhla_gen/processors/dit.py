"""MHLA self-attention for diffusers' ``DiTTransformer2DModel`` (class-conditional DiT).

Replaces the ``attn1`` processor of every ``BasicTransformerBlock`` (stock: ``AttnProcessor2_0``). The
pretrained ``to_q / to_k / to_v / to_out`` of the ``Attention`` module are reused; the processor owns
only the MHLA parameters (mixing matrix, optional CPE and gate). Everything around the attention kernel
follows ``AttnProcessor2_0`` exactly: spatial/group norm, 4D inputs, q/k norms, ``residual_connection``
and ``rescale_output_factor``.
"""

from __future__ import annotations

import torch
from diffusers import DiTTransformer2DModel
from diffusers.models.attention_processor import Attention, AttnProcessor2_0

from .base import MHLAProcessor
from .grid import image_token_grid, square_token_grid


class DiTMHLAProcessor(MHLAProcessor):
    """``AttnProcessor2_0`` with the softmax kernel replaced by MHLA on the 2D token grid."""

    base_name = "dit"
    model_cls = DiTTransformer2DModel
    grid_ndim = 2

    @classmethod
    def self_attention(cls, transformer: DiTTransformer2DModel) -> list[Attention]:
        """``attn1`` of every ``BasicTransformerBlock``."""
        return [block.attn1 for block in transformer.transformer_blocks]

    @classmethod
    def latent_grid(cls, transformer: DiTTransformer2DModel, latent: torch.Tensor) -> tuple[int, int]:
        """The token grid of ``latent``; a non-square one is refused: the self-attention sees ``(B, N, C)``
        and takes the square grid of N (DiT's own unpatchify does the same), so a 3 x 12 grid would run
        as 6 x 6."""
        grid = image_token_grid(transformer, latent)
        if grid[0] != grid[1]:
            raise ValueError(f"DiT runs square latents only (its unpatchify); got a {grid[0]} x {grid[1]} "
                             f"token grid from a latent of shape {tuple(latent.shape)}")
        return grid

    @classmethod
    def stock_processor(cls) -> AttnProcessor2_0:
        return AttnProcessor2_0()

    def forward(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        **unused,
    ) -> torch.Tensor:
        """hidden_states ``(B, N, C)`` (or ``(B, C, H, W)``) -> same shape."""
        self.check_self_attention(encoder_hidden_states, attention_mask, "DiT")
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
            grid = (height, width)
        else:
            grid = square_token_grid(hidden_states.shape[1])  # DiT's own grids are square
        batch_size = hidden_states.shape[0]
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        layer_input = hidden_states  # (B, N, C): what the gate reads
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)  # (B, N, heads * d)
        head_dim = key.shape[-1] // attn.heads

        # (B, N, heads * d) -> (B, heads, N, d)
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        heads_value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        hidden_states = self.attend(query, key, heads_value, grid)  # (B, heads, N, d)
        # (B, heads, N, d) -> (B, N, heads * d): a view (the op writes heads-interleaved memory)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = self.apply_extras(hidden_states, value, layer_input, grid)

        hidden_states = attn.to_out[0](hidden_states)  # linear proj
        hidden_states = attn.to_out[1](hidden_states)  # dropout
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        if attn.rescale_output_factor != 1.0:  # x / 1.0 == x exactly; skipping it saves a pass and its grad
            hidden_states = hidden_states / attn.rescale_output_factor
        return hidden_states

