"""MHLA self-attention for diffusers' ``SanaTransformer2DModel`` (text-to-image SANA).

Replaces ``attn1`` of every ``SanaTransformerBlock`` (stock: ``SanaLinearAttnProcessor2_0``, i.e. global
ReLU linear attention); the cross-attention ``attn2`` stays stock. Pretrained q/k/v/out weights are
reused. With ``blocks=(1, 1)``, no extras and ``eps=1e-15`` this is exactly the stock processor.

The token grid comes from the block: a forward pre-hook on each ``SanaTransformerBlock`` (installed by
``install_mhla``, see ``grid.py``) sets :attr:`SanaMHLAProcessor.token_grid` from the block's
``height`` / ``width`` arguments right before the block runs (and a forward hook clears it afterwards).
"""

from __future__ import annotations

import torch
from diffusers import SanaTransformer2DModel
from diffusers.models.attention_processor import Attention, SanaLinearAttnProcessor2_0

from .base import MHLAProcessor
from .grid import clear_block_grid, image_token_grid, sana_block_grid


class SanaMHLAProcessor(MHLAProcessor):
    """``SanaLinearAttnProcessor2_0`` with the global linear attention replaced by block-mixed MHLA."""

    base_name = "sana"
    model_cls = SanaTransformer2DModel
    grid_ndim = 2
    token_grid: tuple[int, int] | None = None  # set per call by the block's pre-hook

    @classmethod
    def self_attention(cls, transformer: SanaTransformer2DModel) -> list[Attention]:
        """``attn1`` of every ``SanaTransformerBlock`` (``attn2`` is the cross-attention)."""
        return [block.attn1 for block in transformer.transformer_blocks]

    @classmethod
    def latent_grid(cls, transformer: SanaTransformer2DModel, latent: torch.Tensor) -> tuple[int, int]:
        return image_token_grid(transformer, latent)

    @classmethod
    def stock_processor(cls) -> SanaLinearAttnProcessor2_0:
        return SanaLinearAttnProcessor2_0()

    @classmethod
    def grid_hooks(cls, transformer: SanaTransformer2DModel) -> list:
        """A pre-hook that hands each MHLA block its ``height`` / ``width``, and a hook that clears them."""
        blocks = [b for b in transformer.transformer_blocks if isinstance(b.attn1.processor, cls)]
        return [b.register_forward_pre_hook(sana_block_grid, with_kwargs=True) for b in blocks] + [
            b.register_forward_hook(clear_block_grid, always_call=True) for b in blocks
        ]

    def forward(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **unused,
    ) -> torch.Tensor:
        """hidden_states ``(B, N, C)`` -> ``(B, N, C)``."""
        self.check_self_attention(encoder_hidden_states, attention_mask, "SANA")
        grid = self.token_grid
        if grid is None:
            raise ValueError(
                "SANA MHLA processor called outside a SanaTransformerBlock of a model prepared by "
                "install_mhla (the block's height/width give the token grid)"
            )
        original_dtype = hidden_states.dtype
        layer_input = hidden_states  # (B, N, C): what the gate reads
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)  # (B, N, heads * d)
        if attn.norm_q is not None:  # SANA normalises across heads, before the head split
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # (B, N, heads * d) -> (B, heads, N, d)
        split_heads = lambda t: t.unflatten(-1, (attn.heads, -1)).transpose(1, 2)
        query, key, heads_value = split_heads(query), split_heads(key), split_heads(value)
        hidden_states = self.attend(query, key, heads_value, grid)  # (B, heads, N, d), fp32 sums inside
        hidden_states = hidden_states.transpose(1, 2).flatten(2).to(original_dtype)  # (B, N, heads * d)
        hidden_states = self.apply_extras(hidden_states, value, layer_input, grid)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if original_dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states

