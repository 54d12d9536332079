"""Inference assembly: one module per base model, each returning a stock diffusers pipeline whose
transformer runs MHLA self-attention (``load_dit_pipeline``, ``load_sana_pipeline``, ``load_wan_pipeline``)
and saying how to call it (a :class:`PipelineSampler` subclass, named by the base record's ``sampler``).

A plain subpackage of mhla_gen (``from mhla_gen.pipelines.dit import load_dit_pipeline``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from mhla_gen.errors import ConfigError
from mhla_gen.integration.install import (
    CONFIG_KEY,
    MHLA_MODEL_CLASSES,
    install_mhla,
    is_mhla_installed,
    stock_class_name,
)
from mhla_gen.integration.loading import load_transformer
from mhla_gen.integration.serialization import saved_with_mhla
from mhla_gen.processors.config import MHLAConfig

logger = logging.getLogger(__name__)


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
    3. otherwise the pretrained transformer (local folder or hub id; through its MHLA class when its
       config records MHLA) with ``mhla`` installed fresh when it has none.

    Logs (INFO) which transformer it loaded and the MHLA it runs.

    Raises:
        ValueError: the saved transformer is another model class, or ``mhla`` differs from the MHLA it
            was saved with (installing would throw the trained MHLA weights away; pass ``mhla=None``).
    """
    saved = Path(transformer_path) if transformer_path is not None else Path(path_or_id) / subfolder
    if transformer_path is not None or saved_with_mhla(saved):
        transformer = load_transformer(saved, torch_dtype, base=path_or_id)  # base: LoRA folders only
    else:
        config = model_cls.load_config(path_or_id, subfolder=subfolder)
        cls = MHLA_MODEL_CLASSES.get(model_cls, model_cls) if CONFIG_KEY in config else model_cls
        transformer = cls.from_pretrained(path_or_id, subfolder=subfolder, dtype=torch_dtype)
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


@dataclass
class SampleSettings:
    """How to sample, for every base (a base reads the fields it has: DiT has no size or prompts).
    ``None``: the pipeline's own default (the key is not passed)."""

    steps: int = 20
    guidance: float = 4.0
    height: int | None = None
    width: int | None = None
    frames: int | None = None  # video bases
    negative_prompt: str | None = None
    max_sequence_length: int | None = None
    output_type: str | None = None  # None: the pipeline's default (PIL images, numpy video frames)
    extra: dict = field(default_factory=dict)  # passed to the pipeline call as-is

    def optional(self, **names: str) -> dict:
        """``{pipeline keyword: value}`` of the settings that are set, ``names`` mapping keyword -> field."""
        values = {key: getattr(self, name) for key, name in names.items()}
        return {key: value for key, value in values.items() if value is not None}


def check_frames(settings: SampleSettings, pipe) -> None:
    """Video pipelines: ``--frames`` must be ``k·t + 1`` for the VAE's temporal factor ``t`` (None: the
    pipeline's default); ``ConfigError`` naming the setting otherwise."""
    temporal = pipe.vae_scale_factor_temporal
    if settings.frames is not None and (settings.frames - 1) % temporal:
        raise ConfigError(f"--frames {settings.frames} must be {temporal}k + 1")


class PipelineSampler:
    """How a base's stock diffusers pipeline is loaded with an MHLA transformer and called (one subclass
    per base, next to its loader; the base record's ``sampler`` names it). A training run's own pipeline
    is its task's (:func:`mhla_gen.train.runs.run_pipeline`)."""

    @classmethod
    def load(cls, path_or_id, mhla: MHLAConfig | None, torch_dtype: torch.dtype, device, transformer_path):
        """The pipeline of ``path_or_id`` with its MHLA transformer (:func:`load_pipeline_transformer`)."""
        raise NotImplementedError

    @classmethod
    def trained_classes(cls, folder) -> int | None:
        """The classes a class-conditional model was trained on, where a record says; None otherwise."""
        return None

    @classmethod
    def check_conditions(cls, pipe, conditions: Sequence, guidance: float, num_classes: int | None) -> None:
        """Refuse conditions the loaded model cannot sample (ValueError naming them); nothing by default."""

    @classmethod
    def check_settings(cls, transformer_config: dict, settings: SampleSettings) -> None:
        """Refuse settings the model cannot sample, from its transformer's ``config.json`` alone (before
        anything is loaded or written; ConfigError naming the setting); nothing by default."""

    @classmethod
    def check_components(cls, configs: dict, where: str, names: dict[str, str]) -> None:
        """Refuse (ConfigError) a transformer the pipeline's other components cannot run, from their configs
        (``configs``: :func:`mhla_gen.pipelines.checks.local_configs`); nothing by default."""

    @classmethod
    def token_grid(cls, configs: dict, settings: SampleSettings) -> tuple[int, ...] | None:
        """The token grid MHLA tiles when sampling with ``settings``, from the configs alone; None: unknown
        (e.g. no local VAE config)."""
        return None

    @classmethod
    def fit_size(cls, pipe, settings: SampleSettings) -> SampleSettings:
        """``settings`` with the base's default size filled in, checked against the model (ConfigError)."""
        return settings

    @classmethod
    def sample(cls, pipe, conditions: Sequence, generator, settings: SampleSettings):
        """One pipeline call for ``conditions`` (class ids or prompts): its ``images`` or ``frames``."""
        raise NotImplementedError
