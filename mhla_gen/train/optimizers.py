"""``train.optimizer``: the optimizer of a run, each from the library that provides it.

    adamw       torch.optim.AdamW (the default; DiT's)
    adamw8bit   bitsandbytes.optim.AdamW8bit (8-bit states; extra ``[bnb]``), as diffusers' --use_8bit_adam
    prodigy     prodigyopt.Prodigy (learning-rate free: train.learning_rate ~1.0; extra ``[prodigy]``)
    adafactor   torch.optim.Adafactor (factored second moments; train.learning_rate as given)

``train.adam_beta1/2``, ``train.adam_eps`` and ``train.weight_decay`` go to the optimizers that have them.
A missing package is a start-up error in one line naming the extra that installs it
(:func:`check_optimizer`), before anything is written. Checkpoints hold the optimizer's own state
(``accelerator.save_state``), so resume stays exact for each of them.
"""

from __future__ import annotations

import importlib
import logging

import torch
from torch import nn

from .config import ConfigError, TrainConfig

logger = logging.getLogger(__name__)

# train.optimizer -> (module, class, the pip extra of mhla_gen that installs the module, or None)
OPTIMIZER_CLASSES = {
    "adamw": ("torch.optim", "AdamW", None),
    "adamw8bit": ("bitsandbytes.optim", "AdamW8bit", "bnb"),
    "prodigy": ("prodigyopt", "Prodigy", "prodigy"),
    "adafactor": ("torch.optim", "Adafactor", None),
}


def optimizer_class(name: str) -> type:
    """The class of ``train.optimizer=name``; ConfigError naming the extra when its package is missing."""
    module, cls, extra = OPTIMIZER_CLASSES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as err:
        package = module.split(".")[0]
        fix = f"pip install 'mhla_gen[{extra}]' (or pip install {package})" if extra else "upgrade torch"
        raise ConfigError(f"train.optimizer={name} needs {module}.{cls}, which cannot be imported ({err}): "
                          f"{fix}, or choose another train.optimizer") from None


def check_optimizer(tc: TrainConfig) -> None:
    """Before any work: the optimizer's package imports; a Prodigy learning rate far below 1 is warned
    about (Prodigy estimates the step size itself and scales it by the learning rate, as diffusers'
    examples say)."""
    optimizer_class(tc.optimizer)
    if tc.optimizer == "prodigy" and tc.learning_rate <= 0.1:
        logger.warning("train.optimizer=prodigy with train.learning_rate=%g: Prodigy usually wants about 1.0",
                       tc.learning_rate)


def make_optimizer(
    tc: TrainConfig, params: list[nn.Parameter], sharded: bool = False
) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``params`` with the run's learning rate and the settings it takes;
    ``sharded``: FSDP (Prodigy then reduces its step-size estimate over the shards)."""
    cls = optimizer_class(tc.optimizer)
    if tc.optimizer == "adafactor":  # no betas: its second-moment decay is beta2_decay (torch's default)
        return cls(params, lr=tc.learning_rate, weight_decay=tc.weight_decay)
    extra = {"fsdp_in_use": sharded} if tc.optimizer == "prodigy" else {}
    return cls(params, lr=tc.learning_rate, betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps,
               weight_decay=tc.weight_decay, **extra)
