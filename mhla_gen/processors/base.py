"""The base class of the per-model MHLA processors: the MHLA parameters every base shares, and what
``install_mhla`` needs to know about each base model, declared as class attributes and class methods
that every processor class (``dit.py``, ``sana.py``, ``wan.py``) fills in."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..ops import mhla_attention
from ..ops.layout import BlockLayout, layout_for
from ..ops.mixing import MixingMatrix
from .extras import ConvPositionEncoding, OutputGate
from .grid import check_grid
from .skip import attention_scores_skipped, register_skip_output


class MHLAProcessor(nn.Module):
    """Base class of the per-model MHLA processors (DiT, SANA, Wan).

    It owns the learnable MHLA parameters under fixed names, so save/load and the MHLA-only export
    find them the same way for every base: ``mixing`` (:class:`MixingMatrix`), ``cpe``
    (:class:`ConvPositionEncoding` or None) and ``gate`` (:class:`OutputGate` or None). Parameters are
    read through module calls (``self.mixing()``, ``self.cpe(...)``, ``self.gate(...)``), never as
    ``.weight`` attributes: offloading hooks (accelerate's ``cpu_offload``, diffusers' group offloading,
    layerwise casting) put a module's weights in place only around its own forward.

    A subclass also describes its base model to ``install_mhla`` (``processors/__init__.py`` lists the
    subclasses), through these class attributes and class methods:

    Attributes:
        base_name: ``dit``, ``sana`` or ``wan`` (recorded in :func:`save_mhla_parameters` files).
        model_cls: the diffusers transformer class whose self-attention this processor replaces.
        grid_ndim: rank of the token grid, 2 (images) or 3 (video); ``MHLAConfig.blocks`` must match.

    Args:
        cfg: the :class:`MHLAConfig`.
        inner_dim: ``heads * head_dim`` of q/k/v (CPE channels, gate width).
        in_dim: width of the layer input (the gate reads it).
    """

    base_name: ClassVar[str]
    model_cls: ClassVar[type]
    grid_ndim: ClassVar[int]

    def __init_subclass__(cls, **kwargs):
        """Every processor class tells diffusers' layer skip what a skipped attention returns (skip.py)."""
        super().__init_subclass__(**kwargs)
        register_skip_output(cls)

    @classmethod
    def self_attention(cls, transformer: nn.Module) -> list[nn.Module]:
        """The attention module of every self-attention layer of ``transformer``, in depth order (the
        layers ``MHLAConfig.layers`` indexes and ``install_mhla`` may replace)."""
        raise NotImplementedError(f"{cls.__name__} does not say which attentions it replaces")

    @classmethod
    def latent_grid(cls, transformer: nn.Module, latent: torch.Tensor) -> tuple[int, ...]:
        """The token grid of one forward, from its latent's shape and the patch size (checked against
        the blocks before every forward, and recorded by the attention statistics)."""
        raise NotImplementedError(f"{cls.__name__} does not say how a latent maps to its token grid")

    @classmethod
    def for_layer(cls, attn: nn.Module, cfg) -> MHLAProcessor:
        """A fresh processor for the attention module ``attn`` (sizes read from its projections)."""
        return cls(cfg, inner_dim=attn.inner_dim, in_dim=attn.to_q.in_features)

    @classmethod
    def stock_processor(cls):
        """A new stock diffusers processor for these layers (what ``uninstall_mhla`` puts back)."""
        raise NotImplementedError(f"{cls.__name__} does not name the stock processor it replaces")

    softmax_processor_cls: ClassVar[type | None] = None
    """The class of :meth:`softmax_processor`'s processors (None: this base installs none)."""

    @classmethod
    def softmax_processor(cls, attn: nn.Module, cfg):
        """The processor ``install_mhla`` puts in a self-attention layer that ``cfg.layers`` leaves softmax,
        or None: leave that layer's processor as it is (the default: stock attention). Wan's block-causal
        models put block-causal softmax there (``wan_softmax.py``)."""
        return None

    @classmethod
    def check_config(cls, cfg, transformer_config: dict) -> None:
        """Refuse an :class:`MHLAConfig` this base cannot run on a model of ``transformer_config`` (its
        ``config.json``), before anything is installed: ValueError naming the setting. Block-causal
        attention (``chunk_frames``) is built for Wan only."""
        if cfg.chunk_frames is not None:
            raise ValueError(f"chunk_frames={cfg.chunk_frames}: block-causal (streaming) attention is built "
                             f"for Wan only, not for {cls.base_name}")

    @classmethod
    def check_token_grid(cls, cfg, grid: tuple[int, ...]) -> None:
        """ValueError naming both when ``cfg``'s blocks cannot tile a forward's token ``grid``."""
        check_grid(tuple(grid), cfg.blocks)

    @classmethod
    def check_call(cls, transformer: nn.Module, grid: tuple[int, ...]) -> None:
        """What ``install_mhla``'s forward pre-hook checks before a forward of ``transformer`` on ``grid``."""
        cls.check_token_grid(transformer.mhla_config, grid)

    @classmethod
    def grid_hooks(cls, transformer: nn.Module) -> list:
        """Hooks that hand each installed processor the token grid of its own call (``grid.py``); their
        handles, removed by ``uninstall_mhla``. None by default (DiT reads the grid from its input)."""
        return []

    def __init__(self, cfg, inner_dim: int, in_dim: int):
        super().__init__()
        self.cfg = cfg
        # block centres depend only on the block grid, so init W on the (blocks -> blocks) layout
        block_grid = BlockLayout(cfg.blocks, cfg.blocks)
        self.mixing = MixingMatrix(
            block_grid, cfg.mixing_init, cfg.mixing_normalize, cfg.mixing_temperature,
            learnable=cfg.mixing_learnable,
        )
        ndim = len(cfg.blocks)
        self.cpe = ConvPositionEncoding(inner_dim, cfg.cpe_kernel, ndim) if cfg.cpe_kernel else None
        self.gate = OutputGate(in_dim, inner_dim, cfg.gate_activation) if cfg.gate else None

    @staticmethod
    def check_self_attention(encoder_hidden_states, attention_mask, base: str) -> None:
        """MHLA replaces self-attention only, and linear attention cannot apply an attention mask."""
        if encoder_hidden_states is not None:
            raise ValueError("MHLA replaces self-attention only; got encoder_hidden_states (cross-attention)")
        if attention_mask is not None:
            raise ValueError(
                f"MHLA (linear attention) cannot apply an attention_mask; {base} never passes one"
            )

    def layout(self, grid: tuple[int, ...], num_tokens: int) -> BlockLayout:
        """The :class:`BlockLayout` of this call's token grid, checked against the sequence length."""
        layout = layout_for(tuple(grid), self.cfg.blocks)
        layout.check_tokens(num_tokens, "self-attention sequence length")
        return layout

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid) -> torch.Tensor:
        """MHLA of ``(B, heads, N, d)`` q, k, v on the token ``grid`` -> ``(B, heads, N, d)``; v itself
        under diffusers' ``skip_attention_scores`` (identity attention, ``skip.py``)."""
        cfg = self.cfg
        layout = self.layout(grid, q.shape[2])
        if attention_scores_skipped():
            return v
        return mhla_attention(q, k, v, layout, self.mixing(), cfg.feature_map, cfg.normalize, eps=cfg.eps)

    def apply_extras(self, out, value, layer_input, grid) -> torch.Tensor:
        """CPE and gate on merged heads: out, value ``(B, N, inner_dim)``, layer_input ``(B, N, in_dim)``."""
        if self.cpe is not None:
            out = out + self.cpe(value, grid).to(out.dtype)
        if self.gate is not None:
            out = self.gate(out, layer_input)
        return out
