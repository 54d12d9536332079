"""Inference assembly: one module per base model, each returning a stock diffusers pipeline whose
transformer runs MHLA self-attention (``load_dit_pipeline``, ``load_sana_pipeline``, ``load_wan_pipeline``).

A plain subpackage of mhla_gen (``from mhla_gen.pipelines.dit import load_dit_pipeline``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from mhla_gen.config import MHLAConfig
from mhla_gen.install import CONFIG_KEY, MHLA_MODEL_CLASSES, install_mhla, is_mhla_installed, stock_class_name
from mhla_gen.loading import load_transformer
from mhla_gen.serialization import saved_with_mhla

logger = logging.getLogger(__name__)


def load_pipeline_transformer(
    model_cls: type,
    path_or_id,
    mhla: MHLAConfig | None = None,
    torch_dtype: torch.dtype | None = None,
    transformer_path=None,
) -> nn.Module:
    """The transformer of a pipeline, with MHLA, found in this order:

    1. ``transformer_path``: a folder written by ``transformer.save_pretrained`` (e.g. ``runs/x/final``),
       or a LoRA + MHLA folder (``train.trainable=lora`` runs), applied to ``path_or_id``'s transformer;
    2. ``path_or_id/transformer`` when that local folder was saved with MHLA (a whole saved pipeline);
    3. otherwise the pretrained transformer (local folder or hub id; through its MHLA class when its
       config records MHLA) with ``mhla`` installed fresh when it has none.

    Logs (INFO) which transformer it loaded and the MHLA it runs.

    Raises:
        ValueError: the saved transformer is another model class, or ``mhla`` differs from the MHLA it
            was saved with (installing would throw the trained MHLA weights away; pass ``mhla=None``).
    """
    saved = Path(transformer_path) if transformer_path is not None else Path(path_or_id) / "transformer"
    if transformer_path is not None or saved_with_mhla(saved):
        transformer = load_transformer(saved, base=path_or_id)  # base: LoRA folders only
        if torch_dtype is not None and transformer.dtype != torch_dtype:  # no no-op cast: diffusers warns
            transformer = transformer.to(torch_dtype)
    else:
        config = model_cls.load_config(path_or_id, subfolder="transformer")
        cls = MHLA_MODEL_CLASSES.get(model_cls, model_cls) if CONFIG_KEY in config else model_cls
        transformer = cls.from_pretrained(path_or_id, subfolder="transformer", dtype=torch_dtype)
    if not isinstance(transformer, model_cls):
        raise ValueError(
            f"the transformer at {saved} is a {stock_class_name(type(transformer).__name__)}, not a "
            f"{model_cls.__name__} (wrong base model for this pipeline?)"
        )
    if mhla is not None:
        if is_mhla_installed(transformer) and transformer.mhla_config != mhla:
            raise ValueError(
                f"the transformer at {saved} was saved with MHLA {transformer.mhla_config.to_dict()}; "
                f"refusing to replace its trained MHLA with {mhla.to_dict()} "
                "(pass mhla=None to use the saved one)"
            )
        if not is_mhla_installed(transformer):
            install_mhla(transformer, mhla)
    logger.info("pipeline transformer: %s from %s, %s", type(transformer).__name__, saved if saved.is_dir()
                else path_or_id, f"MHLA {transformer.mhla_config.to_dict()}" if is_mhla_installed(transformer)
                else "stock attention (no MHLA)")
    return transformer
