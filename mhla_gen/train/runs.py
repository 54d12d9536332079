"""Sampling from a training run's folder: the run's own pipeline and the classes it trained on.

``mhla-gen generate run_config=RUN/config.yaml`` samples a run without a pipeline folder when the base's
training task can rebuild its sampler from the config alone (``rebuilds_pipeline``: DiT, pixel space or its
data's VAE). The task, not the pipeline module, knows how: pipelines sit below training.
"""

from __future__ import annotations

from pathlib import Path

from ..bases import Base
from ..integration.loading import load_transformer
from .config import load_config


def rebuilds_pipeline(record: Base) -> bool:
    """Whether ``record``'s training task rebuilds its pipeline from a run's config (``run_config=``)."""
    return record.trains and getattr(record.task.load(), "rebuilds_pipeline", False)


def run_pipeline(record: Base, run_config, transformer_path, mhla, torch_dtype, device):
    """The pipeline of the training run whose ``config.yaml`` is ``run_config``: its transformer
    (``transformer_path``, else the run's ``final/``) in the run task's own pipeline."""
    if not rebuilds_pipeline(record):
        raise ValueError(f"base={record.name} samples pipeline folders only: give `model`, not `run_config`")
    if mhla is not None:
        raise ValueError("`mhla` is for stock transformers; a training run's transformer has its own")
    task = record.task.load()(load_config(record.run_config.load(), run_config))
    path = transformer_path or str(Path(run_config).parent / "final")
    transformer = load_transformer(path, torch_dtype=torch_dtype, device=device)
    task.load_vae(device)  # a latent-space run decodes with its data's VAE
    return task.pipeline(transformer).to(device)


def run_classes(record: Base, run_config) -> int | None:
    """The classes the run of ``run_config`` trained on (None for a base without class labels)."""
    return getattr(load_config(record.run_config.load(), run_config).model, "num_classes", None)
