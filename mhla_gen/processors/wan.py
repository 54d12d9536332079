"""MHLA self-attention for diffusers' ``WanTransformer3DModel`` (Wan2.1 / Wan2.2, T2V and I2V).

Replaces ``attn1`` (self-attention) of every ``WanTransformerBlock`` (stock: ``WanAttnProcessor``, softmax
with 3D RoPE); the cross-attention ``attn2`` (text, and the I2V image context) stays stock. The pretrained
``to_q / to_k / to_v / to_out`` and Wan's ``norm_q / norm_k`` (RMSNorm over all heads, applied before the
head split) are reused exactly as ``WanAttnProcessor`` uses them.

Where RoPE goes (``MHLAConfig.wan_rope``), with ``R`` the rotation of token ``t`` and ``φ`` the feature map:

* ``before_phi`` (default): ``q ← φ(R q)``, ``k ← φ(R k)``, then plain MHLA. Numerator and normaliser
  see the same features, so with ``normalize=True`` every output is a convex combination of values.
  Note that φ = ReLU discards the negative half of the *rotated* vector, so relative position enters
  only through which coordinates survive; that is the price of keeping the weights non-negative.
* ``after_phi_numerator`` (the original release): ``φ`` first, then the numerator uses
  ``R φ(q) · R φ(k)`` (signed: RoPE mixes coordinate pairs) while the normaliser, if any, uses
  ``φ(q) · φ(k)`` without RoPE. The release runs it with ``normalize=False`` and RMS-normalises each
  head's output instead (``wan_head_norm``; its ``g_norm``, here :attr:`WanMHLAProcessor.head_norm`).

RoPE itself is :func:`~mhla_gen.ops.rope.wan_rotary_pair`: q and k in one Triton launch on CUDA (read
once, written once, fp32 inside), the plain :func:`~mhla_gen.ops.rope.apply_wan_rotary` on CPU and under
``torch.compile``; bit-identical either way (``ops/rope.py``).

Order after the attention core: head norm -> merge heads -> CPE / gate (base class) -> ``to_out``.

The token grid comes with the rotary embedding: ``install_mhla`` hooks ``transformer.rope`` so that it
returns a :class:`~mhla_gen.processors.grid.GridRotaryEmb` (see ``grid.py``).

Block-causal (streaming) attention (``MHLAConfig.chunk_frames``, ``docs/streaming.md``; the layers left
softmax run :class:`~mhla_gen.processors.wan_softmax.WanBlockCausalSoftmaxProcessor`): RoPE on q and k,
then ``block_causal_mhla`` (general mixing, the ``(M, M)`` :class:`~mhla_gen.ops.mixing.MixingMatrix` masked)
or ``factorised_block_causal_mhla`` (factorised: ``mixing`` is a :class:`~mhla_gen.ops.factorised_mixing.
FactorisedMixing`, ``W_s`` and a decay per head) over a whole video; for one streamed chunk, the layer's
cache steps instead (``wan_causal.py``; ``mhla_gen.integration.streaming.stream_step``).

Context parallelism (``transformer.enable_parallelism(config=ContextParallelConfig(...))``): diffusers sets
:attr:`WanMHLAProcessor._parallel_config` and splits the sequence; the rope hook still reads the whole
latent, so the grid is the whole grid while ``hidden_states`` and the rotary tables hold this rank's
tokens only. The layer then all-reduces block summaries instead of running the registered op on the
whole sequence, and gathers V for CPE (see ``mhla_gen/ops/context_parallel.py``). ``forward`` hands this
rank's ``TokenShard`` to :meth:`WanMHLAProcessor.attention_core` and ``apply_extras``, the two steps that
differ.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, _get_qkv_projections
from torch import nn

from ..ops import mhla_attention
from ..ops.checks import accumulation_dtype, cast_output
from ..ops.context_parallel import TokenShard, context_parallel_shard, mhla_shard, shard_cpe
from ..ops.factorised_mixing import FactorisedMixing
from ..ops.feature_maps import get_feature_map
from ..ops.layout import BlockLayout
from ..ops.rope import apply_wan_rotary, wan_rotary_pair  # noqa: F401 (the reference, importable here)
from ..ops.streaming import block_causal_mhla, factorised_block_causal_mhla
from .base import MHLAProcessor
from .grid import STREAM_ATTR, GridRotaryEmb, wan_rotary_with_grid
from .skip import attention_scores_skipped
from .wan_causal import block_causal_for, check_chunk_grid, check_stream_config
from .wan_softmax import WanBlockCausalSoftmaxProcessor


def mhla_rope_on_numerator(q, k, v, rotary_emb, layout, mixing, feature_map: str, normalize: bool,
                           eps: float) -> torch.Tensor:
    """MHLA with RoPE on the numerator only (the Wan release's ``after_phi_numerator``, SANA-Video's fixed
    placement): ``R φ(q) · R φ(k)`` weighs the values, ``φ(q) · φ(k)`` the normaliser. Two passes of the
    registered op with the identity feature map on precomputed features in the accumulation dtype (the
    normaliser's value is ones: its summary is ``z_j``). q, k, v ``(B, heads, N, d)`` -> same, q's dtype."""
    acc = accumulation_dtype(q.dtype)
    phi = get_feature_map(feature_map)
    fq, fk = phi(q.to(acc)), phi(k.to(acc))  # (B, heads, N, d)
    rq, rk = wan_rotary_pair(fq, fk, *rotary_emb)
    # Σ_s W[b(t), b(s)] (R φ(q_t))·(R φ(k_s)) v_s
    numerator = mhla_attention(rq, rk, v.to(acc), layout, mixing, feature_map="identity", normalize=False)
    if not normalize:
        return cast_output(numerator, q.dtype)
    ones = torch.ones_like(v[..., :1], dtype=acc)  # (B, heads, N, 1)
    # Σ_s W[b(t), b(s)] φ(q_t)·φ(k_s): the normaliser without RoPE
    denominator = mhla_attention(fq, fk, ones, layout, mixing, feature_map="identity", normalize=False)
    return cast_output(numerator / (denominator + eps), q.dtype)


class HeadRMSNorm(nn.Module):
    """RMSNorm over the head dim, shared by all heads (the release's ``g_norm``), in the input's dtype."""

    def __init__(self, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.eps)


class WanMHLAProcessor(MHLAProcessor):
    """``WanAttnProcessor`` for self-attention with softmax replaced by MHLA on the 3D token grid.

    Args:
        cfg, inner_dim, in_dim: see :class:`MHLAProcessor`.
        heads: number of attention heads (``head_dim = inner_dim / heads``).
        head_norm_eps: epsilon of the per-head RMSNorm (Wan uses its block ``eps``, 1e-6).

    Attributes:
        head_norm: :class:`HeadRMSNorm` shared by all heads when ``cfg.wan_head_norm`` (the release's
            ``g_norm``), else None. Initialised to weight 1.
        _parallel_config: diffusers' ``ParallelConfig``, set by ``enable_parallelism`` (and by
            ``install_mhla`` on a model already parallelised); None without context parallelism.
    """

    base_name = "wan"
    model_cls = WanTransformer3DModel
    grid_ndim = 3
    _parallel_config = None

    @classmethod
    def self_attention(cls, transformer: WanTransformer3DModel) -> list[WanAttention]:
        """``attn1`` of every ``WanTransformerBlock`` (``attn2`` is the cross-attention)."""
        return [block.attn1 for block in transformer.blocks]

    @classmethod
    def latent_grid(cls, transformer: WanTransformer3DModel, latent: torch.Tensor) -> tuple[int, int, int]:
        return wan_token_grid(transformer, latent)

    @classmethod
    def for_layer(cls, attn: WanAttention, cfg) -> WanMHLAProcessor:
        """A fresh processor sized from ``attn``; the head norm takes the epsilon of Wan's q norm."""
        return cls(
            cfg,
            inner_dim=attn.inner_dim,
            in_dim=attn.to_q.in_features,
            heads=attn.heads,
            head_norm_eps=attn.norm_q.eps,
        )

    @classmethod
    def stock_processor(cls) -> WanAttnProcessor:
        return WanAttnProcessor()

    @classmethod
    def grid_hooks(cls, transformer: WanTransformer3DModel) -> list:
        """A hook on ``transformer.rope`` that tags the rotary embedding with the token grid."""
        return [transformer.rope.register_forward_hook(wan_rotary_with_grid)]

    softmax_processor_cls = WanBlockCausalSoftmaxProcessor

    @classmethod
    def softmax_processor(cls, attn: WanAttention, cfg) -> WanBlockCausalSoftmaxProcessor | None:
        """A block-causal model's softmax layers run block-causal softmax (``wan_softmax.py``); a
        bidirectional model's keep their processor."""
        return WanBlockCausalSoftmaxProcessor(cfg) if cfg.chunk_frames is not None else None

    @classmethod
    def check_config(cls, cfg, transformer_config: dict) -> None:
        """Block-causal attention needs a temporal patch of 1 (``wan_causal.py``)."""
        check_stream_config(cfg, transformer_config)

    @classmethod
    def check_token_grid(cls, cfg, grid: tuple[int, ...]) -> None:
        """The blocks fit ``grid``; with ``chunk_frames`` also the chunks (:func:`check_chunk_grid`)."""
        if cfg.chunk_frames is None:
            return super().check_token_grid(cfg, grid)
        check_chunk_grid(cfg, grid)

    @classmethod
    def check_call(cls, transformer: WanTransformer3DModel, grid: tuple[int, ...]) -> None:
        """A streamed chunk was checked against its cache (``mhla_gen.integration.streaming``); a whole video
        here."""
        if getattr(transformer.rope, STREAM_ATTR, None) is None:
            cls.check_token_grid(transformer.mhla_config, grid)

    def __init__(self, cfg, inner_dim: int, in_dim: int, heads: int, head_norm_eps: float = 1e-6):
        super().__init__(cfg, inner_dim, in_dim)
        if inner_dim % heads:
            raise ValueError(f"inner_dim {inner_dim} is not divisible by heads {heads}")
        self.heads = heads
        self.head_norm = HeadRMSNorm(inner_dim // heads, eps=head_norm_eps) if cfg.wan_head_norm else None
        if cfg.chunk_frames is not None and cfg.stream_mixing == "factorised":
            # W_s over the blocks of one chunk and a decay per head replace the base class's (M, M) W
            self.mixing = FactorisedMixing(BlockLayout(cfg.blocks, cfg.blocks), heads, rule=cfg.mixing_init,
                                           normalize=cfg.mixing_normalize, temperature=cfg.mixing_temperature)

    def mixing_args(self) -> tuple[torch.Tensor, ...]:
        """What a block-causal step mixes with: ``(W,)`` (general) or ``(W_s, γ)`` (factorised)."""
        mixing = self.mixing()
        return mixing if isinstance(mixing, tuple) else (mixing,)

    def attend_block_causal(self, q, k, v, rotary_emb: GridRotaryEmb) -> torch.Tensor:
        """Block-causal MHLA of rotated q, k and v ``(B, heads, N, d)``: the layer's cache for a streamed
        chunk, else the whole video of ``rotary_emb.grid`` (general or factorised mixing) -> same shape."""
        cfg = self.cfg
        if rotary_emb.stream is not None:
            return rotary_emb.stream.step(self, q, k, v, *self.mixing_args())
        causal = block_causal_for(cfg, rotary_emb.grid)
        causal.layout.check_tokens(q.shape[2], "self-attention sequence length")
        attend = factorised_block_causal_mhla if cfg.stream_mixing == "factorised" else block_causal_mhla
        return attend(q, k, v, causal, *self.mixing_args(), cfg.feature_map, cfg.normalize, cfg.eps)

    def attend_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary_emb) -> torch.Tensor:
        """MHLA with Wan's RoPE placed as ``cfg.wan_rope`` says. q, k, v ``(B, heads, N, d)`` -> same."""
        grid = rotary_emb.grid
        if self.cfg.chunk_frames is not None:  # block-causal: RoPE before φ (MHLAConfig checks it)
            return self.attend_block_causal(*wan_rotary_pair(q, k, *rotary_emb), v, rotary_emb)
        if self.cfg.wan_rope == "before_phi":
            return self.attend(*wan_rotary_pair(q, k, *rotary_emb), v, grid)
        cfg = self.cfg  # after_phi_numerator
        return mhla_rope_on_numerator(q, k, v, rotary_emb, self.layout(grid, q.shape[2]), self.mixing(),
                                      cfg.feature_map, cfg.normalize, cfg.eps)

    def attend_rope_shard(self, q, k, v, rotary_emb, shard: TokenShard) -> torch.Tensor:
        """:meth:`attend_rope` for this rank's tokens under context parallelism (one all-reduce of block
        summaries, ``mhla_gen/ops/context_parallel.py``). q, k, v ``(B, heads, n, d)`` -> same, n =
        ``shard.length``."""
        cfg = self.cfg
        acc = accumulation_dtype(q.dtype)
        phi = get_feature_map(cfg.feature_map)
        args = (rotary_emb.grid, cfg.blocks, self.mixing(), cfg.normalize, cfg.eps)
        if cfg.wan_rope == "before_phi":
            rq, rk = wan_rotary_pair(q, k, *rotary_emb)
            fq, fk = phi(rq.to(acc)), phi(rk.to(acc))  # as the op: rotate, cast, φ
            out = mhla_shard(fq, fk, v.to(acc), *args, shard=shard)
        else:  # after_phi_numerator: RoPE on φ(q), φ(k) in the numerator, plain φ in the normaliser
            fq, fk = phi(q.to(acc)), phi(k.to(acc))
            rq, rk = wan_rotary_pair(fq, fk, *rotary_emb)
            out = mhla_shard(rq, rk, v.to(acc), *args, shard=shard, q_norm_features=fq, k_norm_features=fk)
        return cast_output(out, q.dtype)

    def token_shard(self, rotary_emb, num_tokens: int) -> TokenShard | None:
        """This rank's tokens under context parallelism, None when the layer sees the whole sequence."""
        shard = context_parallel_shard(self._parallel_config, math.prod(rotary_emb.grid), num_tokens)
        if shard is not None and self.cfg.chunk_frames is not None:
            raise ValueError(f"context parallelism is not built for block-causal attention (chunk_frames="
                             f"{self.cfg.chunk_frames})")
        if shard is not None and rotary_emb[0].shape[1] != num_tokens:
            raise ValueError(
                f"context parallelism: the rotary embedding covers {rotary_emb[0].shape[1]} tokens but the "
                f"rank's sequence has {num_tokens}"
            )
        return shard

    def attention_core(self, query, key, value, rotary_emb, shard: TokenShard | None) -> torch.Tensor:
        """RoPE, MHLA and the head norm: what ``dispatch_attention_fn`` (with RoPE applied before it) is
        in ``WanAttnProcessor``. q, k, v ``(B, heads, N, d)`` -> same. ``shard`` is this rank's slice of
        the tokens under context parallelism (None: the whole sequence is here), as diffusers hands its
        attention the ``parallel_config``; the sharded layer all-reduces block summaries instead."""
        attend = self.attend_rope if shard is None else functools.partial(self.attend_rope_shard, shard=shard)
        if attention_scores_skipped():  # diffusers' skip_attention_scores: identity attention (skip.py)
            if rotary_emb.stream is not None:
                raise ValueError("skip_attention_scores (diffusers' layer skip) cannot run in a streamed "
                                 "chunk: the layer's cache would miss the chunk")
            attend = lambda q, k, v, rotary_emb: v  # noqa: E731
        if self.head_norm is None:
            return attend(query, key, value, rotary_emb)
        # no normaliser -> outputs scale with N: keep them in fp32 until the head norm (no fp16 clipping)
        acc = accumulation_dtype(query.dtype)
        return self.head_norm(attend(query.to(acc), key.to(acc), value.to(acc), rotary_emb))

    def apply_extras(self, out, value, layer_input, grid, shard: TokenShard | None = None) -> torch.Tensor:
        """:meth:`MHLAProcessor.apply_extras`, also for this rank's tokens under context parallelism:
        CPE then reads neighbours held by other ranks (``shard_cpe`` gathers V); the gate is per token."""
        if shard is None:
            return super().apply_extras(out, value, layer_input, grid)
        if self.cpe is not None:
            out = out + shard_cpe(self.cpe, value, grid, shard).to(out.dtype)
        if self.gate is not None:
            out = self.gate(out, layer_input)
        return out

    def forward(
        self,
        attn: WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        **unused,
    ) -> torch.Tensor:
        """hidden_states ``(B, N, C)`` in row-major ``(f h w)`` token order -> ``(B, N, C)``."""
        self.check_self_attention(encoder_hidden_states, attention_mask, "Wan")
        if not isinstance(rotary_emb, GridRotaryEmb):
            raise ValueError(
                "Wan MHLA processor needs the rotary embedding of a model prepared by install_mhla (it "
                f"carries the token grid); got {type(rotary_emb).__name__}"
            )
        layer_input = hidden_states  # (B, N, C): what the gate reads
        shard = self.token_shard(rotary_emb, hidden_states.shape[1])  # None: the whole sequence is here
        query, key, value = _get_qkv_projections(attn, hidden_states, None)  # (B, N, heads * d) each
        query = attn.norm_q(query)  # RMSNorm across all heads, before the head split (as Wan does)
        key = attn.norm_k(key)

        # (B, N, heads * d) -> (B, heads, N, d)
        query, key, heads_value = (
            t.unflatten(-1, (attn.heads, -1)).transpose(1, 2) for t in (query, key, value)
        )
        out = self.attention_core(query, key, heads_value, rotary_emb, shard)  # RoPE, MHLA, head norm
        out = out.transpose(1, 2).flatten(2).to(hidden_states.dtype)  # (B, N, heads * d)
        out = self.apply_extras(out, value, layer_input, rotary_emb.grid, shard)

        out = attn.to_out[0](out)
        out = attn.to_out[1](out)
        return out


def wan_token_grid(transformer: WanTransformer3DModel, latent: torch.Tensor) -> tuple[int, int, int]:
    """``(F / pt, H / ph, W / pw)`` for a latent ``(B, C, F, H, W)``, floored as Wan's patch conv does."""
    if latent.dim() != 5:
        raise ValueError(
            f"Wan latents must be (batch, channels, frames, height, width), got {tuple(latent.shape)}"
        )
    pt, ph, pw = transformer.config.patch_size
    frames, height, width = latent.shape[-3:]
    return frames // pt, height // ph, width // pw

