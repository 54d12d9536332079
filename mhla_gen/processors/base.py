"""What ``install_mhla`` needs to know about one base model (one :class:`BaseSpec` per processor module)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..extras import ConvPositionEncoding, OutputGate
from ..layout import BlockLayout, layout_for
from ..mixing import MixingMatrix
from ..ops import mhla_attention


@dataclass(frozen=True)
class BaseSpec:
    """A base transformer family.

    Attributes:
        name: ``dit``, ``sana`` or ``wan``.
        model_cls: the diffusers transformer class.
        grid_ndim: 2 (images) or 3 (video).
        self_attention: ``transformer -> [attention module]`` of every self-attention layer, in depth order.
        token_grid: ``(transformer, latent) -> grid`` from the latent shape and the patch size (checked
            against the blocks before every forward).
        make_processor: ``(attn, cfg) -> nn.Module`` the MHLA processor for one layer.
        grid_hooks: ``transformer -> [hook handles]`` that route each call's grid to the processors
            (see ``processors/grid.py``).
        stock_processor: ``() -> processor`` the stock diffusers processor (for uninstall).
    """

    name: str
    model_cls: type
    grid_ndim: int
    self_attention: Callable[[nn.Module], list[nn.Module]]
    token_grid: Callable[[nn.Module, torch.Tensor], tuple[int, ...]]
    make_processor: Callable[..., nn.Module]
    stock_processor: Callable[[], object]
    grid_hooks: Callable[[nn.Module], list] = lambda transformer: []


class MHLAProcessor(nn.Module):
    """Base class of the per-model MHLA processors (DiT, SANA, Wan).

    It owns the learnable MHLA parameters under fixed names, so save/load and the MHLA-only export
    find them the same way for every base: ``mixing`` (:class:`MixingMatrix`), ``cpe``
    (:class:`ConvPositionEncoding` or None) and ``gate`` (:class:`OutputGate` or None). Parameters are
    read through module calls (``self.mixing()``, ``self.cpe(...)``, ``self.gate(...)``), never as
    ``.weight`` attributes: offloading hooks (accelerate's ``cpu_offload``, diffusers' group offloading,
    layerwise casting) put a module's weights in place only around its own forward.

    Args:
        cfg: the :class:`MHLAConfig`.
        inner_dim: ``heads * head_dim`` of q/k/v (CPE channels, gate width).
        in_dim: width of the layer input (the gate reads it).
    """

    def __init__(self, cfg, inner_dim: int, in_dim: int):
        super().__init__()
        self.cfg = cfg
        # block centres depend only on the block grid, so init W on the (blocks -> blocks) layout
        block_grid = BlockLayout(cfg.blocks, cfg.blocks)
        self.mixing = MixingMatrix(block_grid, cfg.mixing_init, cfg.mixing_normalize, cfg.mixing_temperature)
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
        """MHLA of ``(B, heads, N, d)`` q, k, v on the token ``grid`` -> ``(B, heads, N, d)``."""
        cfg = self.cfg
        layout = self.layout(grid, q.shape[2])
        return mhla_attention(q, k, v, layout, self.mixing(), cfg.feature_map, cfg.normalize, eps=cfg.eps)

    def apply_extras(self, out, value, layer_input, grid) -> torch.Tensor:
        """CPE and gate on merged heads: out, value ``(B, N, inner_dim)``, layer_input ``(B, N, in_dim)``."""
        if self.cpe is not None:
            out = out + self.cpe(value, grid).to(out.dtype)
        if self.gate is not None:
            out = self.gate(out, layer_input)
        return out
