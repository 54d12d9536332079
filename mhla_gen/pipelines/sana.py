"""A stock diffusers ``SanaPipeline`` whose transformer runs MHLA self-attention (``attn1``).

    pipe = load_sana_pipeline("Efficient-Large-Model/Sana_600M_512px_diffusers",
                              transformer_path="runs/sana-mhla/final", torch_dtype=torch.bfloat16)
    image = pipe("a cat", height=512, width=512, use_resolution_binning=False).images[0]

Pass ``use_resolution_binning=False`` for sizes outside SANA's aspect-ratio bins (tiny test models,
or an exact resolution you want MHLA to run at); heights and widths must be multiples of 32.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers import SanaPipeline, SanaTransformer2DModel

from mhla_gen.processors.config import MHLAConfig

from . import PipelineSampler, SampleSettings, load_pipeline_transformer


def load_sana_pipeline(
    path_or_id,
    mhla: MHLAConfig | None = None,
    torch_dtype: torch.dtype = torch.float32,
    device=None,
    transformer_path=None,
) -> SanaPipeline:
    """Load a ``SanaPipeline`` with an MHLA transformer.

    Args:
        path_or_id: a diffusers SANA pipeline folder or hub id (Gemma2 text encoder, tokenizer, DC-AE,
            scheduler).
        mhla: MHLA to install on a stock transformer; None (or equal) when it was saved with MHLA.
        torch_dtype: dtype of the transformer, text encoder and VAE.
        device: where to move the pipeline (None: stay on CPU).
        transformer_path: a saved MHLA transformer folder (e.g. a fine-tuning run's ``final/``) to use
            instead of ``path_or_id/transformer``.
    Returns:
        the pipeline; ``pipe.transformer.mhla_config`` tells which MHLA it runs (absent: stock SANA).
    """
    transformer = load_pipeline_transformer(
        SanaTransformer2DModel, path_or_id, mhla, torch_dtype, transformer_path
    )
    pipe = SanaPipeline.from_pretrained(path_or_id, transformer=transformer, dtype=torch_dtype)
    return pipe.to(device) if device is not None else pipe


class SanaSampler(PipelineSampler):
    """``SanaPipeline``: prompts, any size (resolution binning off: MHLA runs at the size asked for)."""

    @classmethod
    def load(cls, path_or_id, mhla, torch_dtype, device, transformer_path):
        return load_sana_pipeline(path_or_id, mhla, torch_dtype, device, transformer_path=transformer_path)

    @classmethod
    def token_grid(cls, configs: dict, settings: SampleSettings) -> tuple[int, int] | None:
        """``(H / (f p), W / (f p))`` for the DC-AE factor f and patch p (default size: the model's own)."""
        transformer, vae = configs["transformer"], configs.get("vae")
        if vae is None or "encoder_block_out_channels" not in vae:
            return None
        scale = 2 ** (len(vae["encoder_block_out_channels"]) - 1) * transformer["patch_size"]
        size = transformer["sample_size"]
        return (settings.height // scale if settings.height else size // transformer["patch_size"],
                settings.width // scale if settings.width else size // transformer["patch_size"])

    @classmethod
    def fit_size(cls, pipe, settings: SampleSettings) -> SampleSettings:
        """Height and width default to the model's own size."""
        size = pipe.transformer.config.sample_size * pipe.vae_scale_factor
        return dataclasses.replace(settings, height=settings.height or size, width=settings.width or size)

    @classmethod
    def sample(cls, pipe, conditions, generator, settings: SampleSettings):
        optional = settings.optional(max_sequence_length="max_sequence_length", output_type="output_type")
        return pipe(prompt=list(conditions), negative_prompt=settings.negative_prompt or "",
                    height=settings.height, width=settings.width, num_inference_steps=settings.steps,
                    guidance_scale=settings.guidance, generator=generator, use_resolution_binning=False,
                    **optional, **settings.extra).images
