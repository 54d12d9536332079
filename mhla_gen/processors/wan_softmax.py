"""Block-causal softmax self-attention for Wan: the layers of a streaming model that stay softmax.

A Wan transformer installed with ``MHLAConfig.chunk_frames`` is block-causal in every self-attention layer
(``docs/streaming.md``): the layers in ``MHLAConfig.layers`` run block-causal MHLA (``wan.py``), every other
one runs :class:`WanBlockCausalSoftmaxProcessor`, which ``install_mhla`` puts there. ``layers=[]`` makes
the softmax streaming baseline (a KV cache per layer; ``model.attention=softmax`` with ``mhla.chunk_frames``
in the training configs), a list of some layers a hybrid.

The processor is ``WanAttnProcessor``'s self-attention (the same projections, Wan's RMSNorm of q and k
across heads before the head split, the same interleaved RoPE through ``ops.rope.wan_rotary_pair``, SDPA's
``1 / sqrt(d)`` scale, ``to_out``) with the keys restricted to the query's chunk and the chunks before:

* **a whole video**: :func:`~mhla_gen.ops.kv_cache.block_causal_softmax` over the call's token grid (the
  grid rides on the rotary embedding, ``grid.py``);
* **one streamed chunk** (``mhla_gen.integration.streaming.stream_step``): the rotary angles are those of the
chunk's
  absolute frames (the rope hook), and the layer steps its :class:`~mhla_gen.ops.kv_cache.KVStreamCache`
  through the forward's ``StreamCall`` (``wan_causal.py``), as the MHLA layers step theirs.

It calls SDPA directly (diffusers' attention-backend dispatch is not consulted) and has no parameters: a
model's softmax layers keep their pretrained projections, and nothing about them is saved but the config.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, _get_qkv_projections

from ..ops.kv_cache import block_causal_softmax
from ..ops.rope import wan_rotary_pair
from .grid import GridRotaryEmb
from .skip import attention_scores_skipped, register_skip_output


class WanBlockCausalSoftmaxProcessor(WanAttnProcessor):
    """``WanAttnProcessor`` for self-attention, block-causal over chunks of ``cfg.chunk_frames`` latent
    frames. ``cfg``: the model's :class:`~mhla_gen.processors.config.MHLAConfig` (``chunk_frames`` set)."""

    def __init__(self, cfg):
        super().__init__()
        if cfg.chunk_frames is None:
            raise ValueError("WanBlockCausalSoftmaxProcessor needs an MHLAConfig with chunk_frames")
        self.cfg = cfg

    def __call__(
        self,
        attn: WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden_states ``(B, N, C)`` in row-major ``(f h w)`` token order -> ``(B, N, C)``."""
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("block-causal softmax is a self-attention processor: got encoder_hidden_states "
                             "or an attention_mask (Wan passes neither to its self-attention)")
        if not isinstance(rotary_emb, GridRotaryEmb):
            raise ValueError("block-causal softmax needs the rotary embedding of a model prepared by "
                             f"install_mhla (it carries the token grid); got {type(rotary_emb).__name__}")
        if getattr(self._parallel_config, "context_parallel_config", None) is not None:
            raise ValueError(f"context parallelism is not built for block-causal attention (chunk_frames="
                             f"{self.cfg.chunk_frames})")
        query, key, value = _get_qkv_projections(attn, hidden_states, None)  # (B, N, heads * d) each
        query, key = attn.norm_q(query), attn.norm_k(key)  # RMSNorm across heads, before the split
        # (B, N, heads * d) -> (B, heads, N, d)
        q, k, v = (t.unflatten(-1, (attn.heads, -1)).transpose(1, 2) for t in (query, key, value))
        q, k = wan_rotary_pair(q, k, *rotary_emb)
        skipped = attention_scores_skipped()  # diffusers' skip_attention_scores: identity attention (skip.py)
        if skipped and rotary_emb.stream is not None:
            raise ValueError("skip_attention_scores (diffusers' layer skip) cannot run in a streamed chunk: "
                             "the layer's cache would miss the chunk")
        if skipped:  # later chunks' SDPA calls see more keys than queries: diffusers' mode misses them
            out = v
        elif rotary_emb.stream is not None:  # one streamed chunk: this layer's KV cache
            out = rotary_emb.stream.step(self, q, k, v)
        else:
            frames, height, width = rotary_emb.grid
            out = block_causal_softmax(q, k, v, self.cfg.chunk_frames * height * width)
        out = out.transpose(1, 2).flatten(2).type_as(query)  # (B, N, heads * d)
        return attn.to_out[1](attn.to_out[0](out))


register_skip_output(WanBlockCausalSoftmaxProcessor)
