"""A stock diffusers ``SanaVideoPipeline`` whose transformer runs MHLA self-attention (``attn1``).

    pipe = load_sana_video_pipeline("Efficient-Large-Model/SANA-Video_2B_480p_diffusers",
                                    transformer_path="runs/sana-video-mhla/final", torch_dtype=torch.bfloat16)
    video = pipe("a cat surfing", height=480, width=832, frames=81).frames[0]

A fresh install that should start exactly at the stock model (conversion, fine-tuning): uniform mixing
and SANA-Video's epsilon divided by the number of blocks,
``MHLAConfig(blocks=(3, 5, 10), mixing_init="uniform", eps=SANA_VIDEO_EPS / 150)``.
Pass ``use_resolution_binning=False`` for sizes outside SANA-Video's aspect-ratio bins (tiny test
models, or an exact resolution), and ``complex_human_instruction=None`` with a tokenizer that is not Gemma's.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers import SanaVideoPipeline, SanaVideoTransformer3DModel

from mhla_gen.errors import ConfigError
from mhla_gen.processors.config import MHLAConfig

from . import PipelineSampler, SampleSettings, check_frames, load_pipeline_transformer
from .checks import video_token_grid

SANA_VIDEO_DEFAULT_SIZE = (480, 832)  # SanaVideoPipeline's default height and width


def load_sana_video_pipeline(
    path_or_id,
    mhla: MHLAConfig | None = None,
    torch_dtype: torch.dtype = torch.bfloat16,
    device=None,
    transformer_path=None,
    vae_dtype: torch.dtype = torch.float32,
) -> SanaVideoPipeline:
    """Load a ``SanaVideoPipeline`` with an MHLA transformer.

    Args:
        path_or_id: a diffusers SANA-Video pipeline folder or hub id (Gemma2 text encoder, tokenizer, Wan
            VAE, scheduler).
        mhla: MHLA to install on a stock transformer; None (or equal) when it was saved with MHLA.
        torch_dtype: dtype of the transformer and text encoder.
        device: where to move the pipeline (None: stay on CPU).
        transformer_path: a saved MHLA transformer folder (e.g. a fine-tuning run's ``final/``) to use
            instead of ``path_or_id/transformer``.
        vae_dtype: the VAE (Wan's at 480p) runs in float32, as diffusers' SANA-Video examples do.
    Returns:
        the pipeline; ``pipe.transformer.mhla_config`` tells which MHLA it runs (absent: stock SANA-Video).
    """
    transformer = load_pipeline_transformer(
        SanaVideoTransformer3DModel, path_or_id, mhla, torch_dtype, transformer_path
    )
    dtypes = {"default": torch_dtype, "vae": vae_dtype}  # whichever VAE class the folder names
    pipe = SanaVideoPipeline.from_pretrained(path_or_id, transformer=transformer, dtype=dtypes)
    return pipe.to(device) if device is not None else pipe


class SanaVideoSampler(PipelineSampler):
    """``SanaVideoPipeline``: prompts, videos of ``frames`` frames (4k + 1), sizes in multiples of 32,
    resolution binning off (MHLA runs at the size asked for)."""

    @classmethod
    def load(cls, path_or_id, mhla, torch_dtype, device, transformer_path):
        return load_sana_video_pipeline(path_or_id, mhla, torch_dtype, device, transformer_path)

    @classmethod
    def token_grid(cls, configs: dict, settings: SampleSettings) -> tuple[int, int, int] | None:

        height = settings.height or SANA_VIDEO_DEFAULT_SIZE[0]
        width = settings.width or SANA_VIDEO_DEFAULT_SIZE[1]
        return video_token_grid(configs, height, width, settings.frames)

    @classmethod
    def fit_size(cls, pipe, settings: SampleSettings) -> SampleSettings:
        """``(height, width)`` (default 480 x 832), multiples of 32 as the pipeline checks; frames 4k + 1."""
        height = settings.height or SANA_VIDEO_DEFAULT_SIZE[0]
        width = settings.width or SANA_VIDEO_DEFAULT_SIZE[1]
        for name, value in (("height", height), ("width", width)):
            if value % 32:
                raise ConfigError(f"--{name} {value} is not a multiple of 32 (SanaVideoPipeline)")
        check_frames(settings, pipe)
        return dataclasses.replace(settings, height=height, width=width)

    @classmethod
    def sample(cls, pipe, conditions, generator, settings: SampleSettings):
        optional = settings.optional(frames="frames", max_sequence_length="max_sequence_length",
                                     output_type="output_type")
        return pipe(prompt=list(conditions), negative_prompt=settings.negative_prompt or "",
                    height=settings.height, width=settings.width, num_inference_steps=settings.steps,
                    guidance_scale=settings.guidance, generator=generator, use_resolution_binning=False,
                    **optional, **settings.extra).frames
