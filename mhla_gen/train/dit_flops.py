"""The training compute of a DiT run config, per image (the studies compare arms at equal FLOPs with it)."""

from __future__ import annotations

import dataclasses

import torch

from ..metrics.flops import step_flops
from .config import DiTRunConfig
from .dit import DiTTask


def train_flops_per_image(cfg: DiTRunConfig) -> dict[str, float]:
    """``{"forward", "train"}`` FLOPs per image of the transformer a ``DiTRunConfig`` trains: one forward,
    and one training step (forward + backward), counted at batch 1 on the ``meta`` device (no memory, no
    weights; every count scales with the batch). ``model.init_from`` is ignored: the architecture is
    built from the config alone (a converted model has its teacher's shapes and the config's attention).
    The optimizer, the EMA and elementwise work are not counted."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=None))
    with torch.device("meta"):
        model = DiTTask(cfg).build_transformer()
    size, channels = model.config.sample_size, model.config.in_channels
    x = torch.empty(1, channels, size, size, device="meta")
    t, y = (torch.zeros(1, dtype=torch.long, device="meta") for _ in range(2))
    return step_flops(model, {"hidden_states": x, "timestep": t, "class_labels": y})
