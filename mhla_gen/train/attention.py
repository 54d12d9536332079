"""``model.attention`` of every training task: ``softmax``, ``linear`` (global linear attention) or ``mhla``.

The three differ only in the MHLA config installed (none, one block per axis, the configured blocks), so
runs that compare them share every other setting. DiT, SANA and Wan use these the same way.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..config import MHLAConfig
from ..errors import ConfigError
from ..install import install_mhla


def attention_mhla_config(attention: str, mhla: MHLAConfig) -> MHLAConfig | None:
    """``softmax`` -> None; ``linear`` -> one block per axis (global ReLU linear attention, as SANA);
    ``mhla`` -> ``mhla`` as configured. Everything else stays equal, so the three compare fairly."""
    if attention == "softmax":
        return None
    if attention == "linear":
        return dataclasses.replace(mhla, blocks=(1,) * len(mhla.blocks))
    return mhla


def install_attention(transformer: nn.Module, attention: str, mhla: MHLAConfig) -> nn.Module:
    """Install the MHLA of :func:`attention_mhla_config` (nothing for softmax); returns ``transformer``."""
    cfg = attention_mhla_config(attention, mhla)
    if cfg is not None:
        install_mhla(transformer, cfg)
    return transformer


def check_mhla_layers(mhla: MHLAConfig | None, num_layers: int) -> None:
    """``mhla.layers`` must name existing self-attention layers, once each (``install_mhla``'s rule);
    :class:`ConfigError` naming them otherwise."""
    if mhla is None or mhla.layers is None:
        return
    bad = sorted({i for i in mhla.layers if not 0 <= i < num_layers})
    repeated = sorted({i for i in mhla.layers if mhla.layers.count(i) > 1})
    if bad or repeated:
        what = f"{bad} out of range 0..{num_layers - 1}" if bad else f"{repeated} listed twice"
        raise ConfigError(f"mhla.layers={mhla.layers}: layers {what} (the model has {num_layers} layers)")
