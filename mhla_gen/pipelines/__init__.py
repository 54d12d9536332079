"""Inference assembly: one module per base model, each returning a stock diffusers pipeline whose
transformer runs MHLA self-attention (``load_dit_pipeline``, ``load_sana_pipeline``, ``load_wan_pipeline``).

A plain subpackage of mhla_gen (``from mhla_gen.pipelines.dit import load_dit_pipeline``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mhla_gen.config import MHLAConfig
from mhla_gen.install import install_mhla, is_mhla_installed
from mhla_gen.loading import load_transformer
from mhla_gen.serialization import saved_with_mhla


def load_pipeline_transformer(
    model_cls: type,
    path_or_id,
    mhla: MHLAConfig | None = None,
    torch_dtype: torch.dtype | None = None,
    transformer_path=None,
    subfolder: str = "transformer",
) -> nn.Module:
    """The transformer of a pipeline (``subfolder``: ``transformer_2`` for Wan2.2's low-noise expert), with
    MHLA, found in this order:

    1. ``transformer_path``: a folder written by ``transformer.save_pretrained`` (e.g. ``runs/x/final``),
       or a LoRA + MHLA folder (``train.trainable=lora`` runs), applied to ``path_or_id``'s transformer;
    2. ``path_or_id/<subfolder>`` when that local folder was saved with MHLA (a whole saved pipeline);
    3. otherwise the stock pretrained transformer (local folder or hub id) with ``mhla`` installed fresh.

    Raises:
        ValueError: the saved transformer is another model class, or ``mhla`` differs from the MHLA it
            was saved with (installing would throw the trained MHLA weights away; pass ``mhla=None``).
    """
    saved = Path(transformer_path) if transformer_path is not None else Path(path_or_id) / subfolder
    if transformer_path is not None or saved_with_mhla(saved):
        transformer = load_transformer(saved, base=path_or_id)  # base: LoRA folders only
        if torch_dtype is not None and transformer.dtype != torch_dtype:  # no no-op cast: diffusers warns
            transformer = transformer.to(torch_dtype)
    else:
        transformer = model_cls.from_pretrained(path_or_id, subfolder=subfolder, dtype=torch_dtype)
    if not isinstance(transformer, model_cls):
        raise ValueError(
            f"the transformer at {saved} is a {type(transformer).__name__}, not a {model_cls.__name__} "
            "(wrong base model for this pipeline?)"
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
    return transformer
