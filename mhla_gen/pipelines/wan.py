"""A stock diffusers ``WanPipeline`` whose transformer runs MHLA self-attention.

    pipe = load_wan_pipeline("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", transformer_path="runs/wan-mhla/final")
    frames = pipe("a cat surfing", height=480, width=832, num_frames=81).frames[0]

Three ways to get the MHLA transformer, in this order:

1. ``transformer_path``: a folder written by ``transformer.save_pretrained`` after ``install_mhla``
   (fine-tuning output, or ``scripts/convert_wan_mhla.py`` for the released checkpoint);
2. ``path_or_id/transformer`` when that local folder was saved with MHLA (a whole saved pipeline);
3. otherwise the stock pretrained transformer, with ``mhla`` installed fresh (untrained mixing: a
   starting point for fine-tuning, not a sampler that will produce good videos).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

from mhla_gen.config import MHLAConfig
from mhla_gen.errors import ConfigError

from . import PipelineSampler, SampleSettings, load_pipeline_transformer

WAN_DEFAULT_SIZE = (480, 832)  # WanPipeline's default height and width


def load_wan_pipeline(
    path_or_id,
    mhla: MHLAConfig | None = None,
    torch_dtype: torch.dtype = torch.bfloat16,
    device=None,
    transformer_path=None,
    vae_dtype: torch.dtype = torch.float32,
) -> WanPipeline:
    """Load a ``WanPipeline`` with an MHLA transformer.

    Args:
        path_or_id: a diffusers Wan pipeline folder or hub id (text encoder, tokenizer, VAE, scheduler).
        mhla: MHLA to install on a stock transformer. Must be None (or equal) when the transformer was
            saved with MHLA: a fresh install would throw the trained MHLA weights away.
        torch_dtype: dtype of the transformer and text encoder.
        device: where to move the pipeline (None: stay on CPU).
        transformer_path: a saved MHLA transformer folder to use instead of ``path_or_id/transformer``.
        vae_dtype: the Wan VAE is usually run in float32, as the Wan examples in diffusers do.
    Returns:
        the pipeline; ``pipe.transformer.mhla_config`` tells which MHLA it runs (None: stock softmax).
    Raises:
        ValueError: ``mhla`` conflicts with the MHLA the transformer was saved with, or the saved
            transformer is not a ``WanTransformer3DModel``.
    """
    transformer = load_pipeline_transformer(
        WanTransformer3DModel, path_or_id, mhla, torch_dtype, transformer_path
    )
    vae = AutoencoderKLWan.from_pretrained(path_or_id, subfolder="vae", dtype=vae_dtype)
    pipe = WanPipeline.from_pretrained(path_or_id, transformer=transformer, vae=vae, dtype=torch_dtype)
    return pipe.to(device) if device is not None else pipe


class WanSampler(PipelineSampler):
    """``WanPipeline``: prompts, videos of ``frames`` frames (4k + 1)."""

    @classmethod
    def load(cls, path_or_id, mhla, torch_dtype, device, transformer_path):
        return load_wan_pipeline(path_or_id, mhla, torch_dtype, device, transformer_path=transformer_path)

    @classmethod
    def fit_size(cls, pipe, settings: SampleSettings) -> SampleSettings:
        """``(height, width)`` (default 480 x 832), refused when the VAE and patch cannot tile it or its token
        grid exceeds the model's rotary table (``rope_max_seq_len``); frames must be 4k + 1."""
        height, width = settings.height or WAN_DEFAULT_SIZE[0], settings.width or WAN_DEFAULT_SIZE[1]
        config = pipe.transformer.config
        _, ph, pw = config.patch_size
        spatial = pipe.vae_scale_factor_spatial
        for name, value, patch in (("height", height, ph), ("width", width, pw)):
            if value % (spatial * patch):
                raise ConfigError(f"--{name} {value} is not a multiple of {spatial * patch} "
                                  f"(VAE {spatial}x, patch {patch})")
            if value // (spatial * patch) > config.rope_max_seq_len:
                raise ConfigError(
                    f"--height/--width {height}x{width} gives a token grid of {height // (spatial * ph)}x"
                    f"{width // (spatial * pw)}, beyond this model's rope_max_seq_len="
                    f"{config.rope_max_seq_len}; pass a smaller --height/--width"
                )
        if settings.frames is not None and (settings.frames - 1) % pipe.vae_scale_factor_temporal:
            raise ConfigError(f"--frames {settings.frames} must be {pipe.vae_scale_factor_temporal}k + 1")
        return dataclasses.replace(settings, height=height, width=width)

    @classmethod
    def sample(cls, pipe, conditions, generator, settings: SampleSettings):
        optional = settings.optional(num_frames="frames", max_sequence_length="max_sequence_length",
                                     output_type="output_type")
        return pipe(prompt=list(conditions), negative_prompt=settings.negative_prompt,
                    height=settings.height, width=settings.width, num_inference_steps=settings.steps,
                    guidance_scale=settings.guidance, generator=generator, **optional,
                    **settings.extra).frames
