"""A stock diffusers ``DiTPipeline`` whose transformer runs MHLA self-attention.

    pipe = load_dit_pipeline("runs/dit-mhla/pipeline")                       # saved with MHLA
    pipe = load_dit_pipeline("facebook/DiT-XL-2-256", mhla=MHLAConfig.preset("dit-256"))  # fresh MHLA
    images = pipe(class_labels=[207, 360], num_inference_steps=50, guidance_scale=4.0).images

``DiTPipeline`` hard-codes the classifier-free-guidance null class as label 1000, so guidance > 1 needs a
transformer built with ``num_embeds_ada_norm=1000`` (its label table has the null row at index 1000).
Models for small datasets keep the 1000-entry table and use labels ``0..k-1``; a model with another
class count can only sample with ``guidance_scale <= 1`` (:func:`check_class_labels` says so).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import DiTPipeline, DiTTransformer2DModel
from omegaconf import OmegaConf

from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import read_marker
from mhla_gen.processors.config import MHLAConfig

from . import PipelineSampler, SampleSettings, load_pipeline_transformer

DIT_NULL_CLASS = 1000  # hard-coded in DiTPipeline.__call__


def load_dit_pipeline(
    path_or_id,
    mhla: MHLAConfig | None = None,
    torch_dtype: torch.dtype = torch.float32,
    device=None,
    transformer_path=None,
) -> DiTPipeline:
    """Load a ``DiTPipeline`` with an MHLA transformer.

    Args:
        path_or_id: a diffusers DiT pipeline folder or hub id (VAE, scheduler, labels).
        mhla: MHLA to install on a stock transformer; None (or equal) when it was saved with MHLA.
        torch_dtype: dtype of the transformer and VAE.
        device: where to move the pipeline (None: stay on CPU).
        transformer_path: a saved MHLA transformer folder (e.g. a training run's ``final/``) to use
            instead of ``path_or_id/transformer``.
    Returns:
        the pipeline; ``pipe.transformer.mhla_config`` tells which MHLA it runs (absent: stock softmax).
    """
    transformer = load_pipeline_transformer(
        DiTTransformer2DModel, path_or_id, mhla, torch_dtype, transformer_path
    )
    pipe = DiTPipeline.from_pretrained(path_or_id, transformer=transformer, dtype=torch_dtype)
    return pipe.to(device) if device is not None else pipe


def trained_num_classes(folder) -> int | None:
    """The number of classes a DiT saved in ``folder`` was trained on, as its training run recorded it
    (``final/``'s marker, or the run's ``config.yaml`` next to a ``final/`` written before that record
    existed); None when nothing records it (e.g. a hub checkpoint: its label table is the rule)."""
    if folder is None or not Path(folder).is_dir():
        return None
    folder = Path(folder)
    record = read_marker(folder) or {}
    if isinstance(record.get("num_classes"), int):
        return record["num_classes"]
    run = folder.resolve().parent
    if folder.name == "final" and (read_marker(run) or {}).get("kind") == "run":
        try:  # the run's resolved config: read the one setting, no schema (pipelines sit below train/)
            classes = OmegaConf.select(OmegaConf.load(run / "config.yaml"), "model.num_classes")
        except (ValueError, OSError):
            return None
        return classes if isinstance(classes, int) else None
    return None


def check_class_labels(
    transformer: DiTTransformer2DModel,
    labels: list[int],
    guidance_scale: float,
    num_classes: int | None = None,
) -> None:
    """Raise a ValueError for labels the model was not trained on (``num_classes``, from
    :func:`trained_num_classes`; else its label table), a negative guidance scale, or CFG the pipeline
    cannot run."""
    table = transformer.config.num_embeds_ada_norm
    classes = num_classes if num_classes is not None else table
    bad = [label for label in labels if not 0 <= label < classes]
    if bad:
        how = "was trained on" if num_classes is not None else "has"
        raise ValueError(f"class labels {bad} out of range: the model {how} classes 0..{classes - 1}")
    if guidance_scale < 0:
        raise ValueError(f"guidance scale must be >= 0, got {guidance_scale}")
    if guidance_scale > 1 and table != DIT_NULL_CLASS:
        raise ValueError(
            f"DiTPipeline uses label {DIT_NULL_CLASS} as the null class for guidance_scale > 1, but this "
            f"model has num_embeds_ada_norm={table}; sample with guidance_scale <= 1 or train with "
            f"{DIT_NULL_CLASS} classes"
        )


class DiTSampler(PipelineSampler):
    """``DiTPipeline``: class labels, one square size (the model's ``sample_size``)."""

    @classmethod
    def load(cls, path_or_id, mhla, torch_dtype, device, transformer_path):
        return load_dit_pipeline(path_or_id, mhla, torch_dtype, device, transformer_path=transformer_path)

    @classmethod
    def trained_classes(cls, folder) -> int | None:
        return trained_num_classes(folder)

    @classmethod
    def check_components(cls, configs: dict, where: str, names: dict[str, str]) -> None:
        """``DiTPipeline`` draws latents of the transformer's ``in_channels`` and decodes them with its VAE:
        a pixel-space DiT (1 or 3 channels, e.g. the digits) in a latent pipeline would fail only after
        denoising."""
        channels, vae = configs["transformer"].get("in_channels"), configs.get("vae")
        if vae is not None and channels != vae.get("latent_channels"):
            raise ConfigError(
                f"{where} is a DiT on {channels}-channel inputs, but the VAE of {names['model']} makes "
                f"{vae.get('latent_channels')}-channel latents: this pipeline cannot decode its samples. A "
                f"training run's own pipeline (pixel space or its data VAE) is rebuilt by eval/generate.py "
                f"run_config=RUN/config.yaml"
            )

    @classmethod
    def token_grid(cls, configs: dict, settings: SampleSettings) -> tuple[int, int] | None:
        """``(s / p, s / p)``: DiTPipeline samples at the transformer's ``sample_size`` s, or at a requested
        height (``--height``: :meth:`fit_size` makes it the sample size; None without a local VAE config)."""
        config, vae = configs["transformer"], configs.get("vae")
        side = config["sample_size"]
        if settings.height or settings.width:
            if vae is None:
                return None
            side = (settings.height or settings.width) // 2 ** (len(vae["block_out_channels"]) - 1)
        return side // config["patch_size"], side // config["patch_size"]

    @classmethod
    def check_conditions(cls, pipe, conditions, guidance, num_classes) -> None:
        check_class_labels(pipe.transformer, list(conditions), guidance, num_classes)

    @classmethod
    def fit_size(cls, pipe, settings: SampleSettings) -> SampleSettings:
        """A given height / width becomes the transformer's ``sample_size`` (DiTPipeline draws latents of
        that size; DiT's unpatchify needs squares)."""
        if settings.height is None and settings.width is None:
            return settings
        height, width = settings.height or settings.width, settings.width or settings.height
        scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        multiple = scale * pipe.transformer.config.patch_size
        if height != width or height % multiple:
            raise ConfigError(
                f"DiT samples square images whose side is a multiple of {multiple} (VAE x patch); "
                f"got {height}x{width}"
            )
        pipe.transformer.register_to_config(sample_size=height // scale)
        return settings

    @classmethod
    def sample(cls, pipe, conditions, generator, settings: SampleSettings):
        return pipe(class_labels=list(conditions), guidance_scale=settings.guidance,
                    num_inference_steps=settings.steps, generator=generator,
                    **settings.optional(output_type="output_type"), **settings.extra).images
