"""What ``install_mhla`` needs to know about one base model (one :class:`BaseSpec` per processor module)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BaseSpec:
    """A base transformer family.

    Attributes:
        name: ``dit``, ``sana`` or ``wan``.
        model_cls: the diffusers transformer class.
        grid_ndim: 2 (images) or 3 (video).
        self_attention: ``transformer -> [attention module]`` of every self-attention layer, in depth order.
        token_grid: ``(transformer, latent) -> grid`` from the latent shape and the patch size.
        make_processor: ``(attn, cfg, context) -> nn.Module`` the MHLA processor for one layer.
        stock_processor: ``() -> processor`` the stock diffusers processor (for uninstall).
    """

    name: str
    model_cls: type
    grid_ndim: int
    self_attention: Callable[[nn.Module], list[nn.Module]]
    token_grid: Callable[[nn.Module, torch.Tensor], tuple[int, ...]]
    make_processor: Callable[..., nn.Module]
    stock_processor: Callable[[], object]
