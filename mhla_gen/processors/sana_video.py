"""MHLA self-attention for diffusers' ``SanaVideoTransformer3DModel`` (SANA-Video).

Replaces ``attn1`` of every ``SanaVideoTransformerBlock`` (stock: ``SanaLinearAttnProcessor3_0``, global
ReLU linear attention with 3D RoPE); the cross-attention ``attn2`` stays stock. The pretrained
``to_q / to_k / to_v / to_out`` and the q/k RMSNorm across heads are reused as the stock processor uses them.

RoPE sits where SANA-Video puts it, always (``MHLAConfig.wan_rope`` is not read): ``φ`` first, then the
numerator uses the rotated features ``R φ(q) · R φ(k)`` while the normaliser uses ``φ(q) · φ(k)``:

    o_t = Σ_s W[b(t), b(s)] (R_t φ(q_t))·(R_s φ(k_s)) v_s / (Σ_s W[b(t), b(s)] φ(q_t)·φ(k_s) + eps)

RoPE is Wan's interleaved rotation, the same tables (a ``WanRotaryPosEmbed``), applied by
:func:`~mhla_gen.ops.rope.wan_rotary_pair` (one Triton launch for φ(q) and φ(k) on CUDA).

The stock layer is this with one block (or any blocks and uniform mixing, rows ``1/M``) and eps ``1e-15``;
uniform mixing divides numerator and normaliser by ``M``, so ``eps = 1e-15 / M`` gives the stock output
exactly (up to fp32 round-off): a conversion starts where the checkpoint is, as for SANA.

The token grid ``(F / pt, H / ph, W / pw)`` travels with the rotary embedding, as for Wan: ``install_mhla``
hooks ``transformer.rope`` (a ``WanRotaryPosEmbed``) so that it returns a
:class:`~mhla_gen.processors.grid.GridRotaryEmb`, which the block hands to ``attn1`` (also when a
checkpointed block is recomputed). diffusers 0.42 declares no context-parallel plan for SANA-Video, so
there is no sharded path here.
"""

from __future__ import annotations

import torch
from diffusers import SanaVideoTransformer3DModel
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_sana_video import SanaLinearAttnProcessor3_0

from .base import MHLAProcessor
from .grid import GridRotaryEmb, wan_rotary_with_grid
from .skip import attention_scores_skipped
from .wan import mhla_rope_on_numerator

SANA_VIDEO_EPS = 1e-15
"""The stock processor's normaliser epsilon (``SanaLinearAttnProcessor3_0``)."""


def video_token_grid(transformer: torch.nn.Module, latent: torch.Tensor) -> tuple[int, int, int]:
    """``(F / pt, H / ph, W / pw)`` for a latent ``(B, C, F, H, W)``, floored as the patch conv does."""
    if latent.dim() != 5:
        raise ValueError(
            f"{type(transformer).__name__} latents must be (batch, channels, frames, height, width), "
            f"got {tuple(latent.shape)}"
        )
    pt, ph, pw = transformer.config.patch_size
    frames, height, width = latent.shape[-3:]
    return frames // pt, height // ph, width // pw


class SanaVideoMHLAProcessor(MHLAProcessor):
    """``SanaLinearAttnProcessor3_0`` with the global linear attention replaced by block-mixed MHLA."""

    base_name = "sana-video"
    model_cls = SanaVideoTransformer3DModel
    grid_ndim = 3

    @classmethod
    def self_attention(cls, transformer: SanaVideoTransformer3DModel) -> list[Attention]:
        """``attn1`` of every ``SanaVideoTransformerBlock`` (``attn2`` is the cross-attention)."""
        return [block.attn1 for block in transformer.transformer_blocks]

    @classmethod
    def latent_grid(
        cls, transformer: SanaVideoTransformer3DModel, latent: torch.Tensor
    ) -> tuple[int, int, int]:
        return video_token_grid(transformer, latent)

    @classmethod
    def for_layer(cls, attn: Attention, cfg) -> SanaVideoMHLAProcessor:
        if cfg.wan_head_norm:
            raise ValueError("mhla.wan_head_norm=True is for Wan models only; SANA-Video has a normaliser")
        return cls(cfg, inner_dim=attn.inner_dim, in_dim=attn.to_q.in_features)

    @classmethod
    def stock_processor(cls) -> SanaLinearAttnProcessor3_0:
        return SanaLinearAttnProcessor3_0()

    @classmethod
    def grid_hooks(cls, transformer: SanaVideoTransformer3DModel) -> list:
        """A hook on ``transformer.rope`` that tags the rotary embedding with the token grid."""
        return [transformer.rope.register_forward_hook(wan_rotary_with_grid)]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        """``nn.Module.__call__`` (hooks included) under a signature that names ``rotary_emb``: diffusers'
        ``Attention.forward`` passes on only the keyword arguments the processor's ``__call__`` names."""
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)

    def attend_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary_emb) -> torch.Tensor:
        """MHLA with RoPE on the numerator only (:func:`~mhla_gen.processors.wan.mhla_rope_on_numerator`).
        q, k, v ``(B, heads, N, d)`` -> same, q's dtype; v under ``skip_attention_scores`` (``skip.py``)."""
        cfg = self.cfg
        if attention_scores_skipped():
            return v
        return mhla_rope_on_numerator(q, k, v, rotary_emb, self.layout(rotary_emb.grid, q.shape[2]),
                                      self.mixing(), cfg.feature_map, cfg.normalize, cfg.eps)

    def forward(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: GridRotaryEmb | None = None,
    ) -> torch.Tensor:
        """hidden_states ``(B, N, C)`` in row-major ``(f h w)`` token order -> ``(B, N, C)``."""
        self.check_self_attention(encoder_hidden_states, attention_mask, "SANA-Video")
        if not isinstance(rotary_emb, GridRotaryEmb):
            raise ValueError(
                "SANA-Video MHLA processor needs the rotary embedding of a model prepared by install_mhla "
                f"(it carries the token grid); got {type(rotary_emb).__name__}"
            )
        original_dtype = hidden_states.dtype
        layer_input = hidden_states  # (B, N, C): what the gate reads
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:  # RMSNorm across heads, before the head split (as the stock layer)
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # (B, N, heads * d) -> (B, heads, N, d)
        split_heads = lambda t: t.unflatten(-1, (attn.heads, -1)).transpose(1, 2)
        out = self.attend_rope(split_heads(query), split_heads(key), split_heads(value), rotary_emb)
        out = out.transpose(1, 2).flatten(2).to(original_dtype)  # (B, N, heads * d)
        out = self.apply_extras(out, value, layer_input, rotary_emb.grid)

        out = attn.to_out[0](out)
        return attn.to_out[1](out)
