"""Flow-matching fine-tuning of pretrained SANA-Video into MHLA (``scripts/finetune_sana_video.py``), and the
base task of its stage-1 conversion (``scripts/linearize.py --base sana-video``).

SANA-Video is Wan's data and latents (videos, the Wan VAE, 4k + 1 frames) with SANA's text side (Gemma2,
an attention mask on the caption, ``complex_human_instruction`` off as in SANA fine-tuning) and its own
pipeline (``SanaVideoPipeline``: ``frames=``, sizes in multiples of 32, resolution binning off). Its
attention is global linear attention with RoPE on the numerator, so MHLA with ``mhla.mixing_init=uniform``
and ``mhla.eps=1e-15 / M`` starts exactly at the checkpoint (``processors/sana_video.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..bases.sana_video import BASE as SANA_VIDEO
from .config import CaptionDataConfig, ConfigError, FinetuneModelConfig, FlowMatchingConfig, RunConfig
from .finetune import GemmaCaptions, WanTask


@dataclass
class SanaVideoRunConfig(RunConfig):
    output_dir: str = "runs/sana_video"
    model: FinetuneModelConfig = field(default_factory=FinetuneModelConfig)
    data: CaptionDataConfig = field(
        default_factory=lambda: CaptionDataConfig(height=480, width=832, max_sequence_length=300)
    )
    flow: FlowMatchingConfig = field(default_factory=FlowMatchingConfig)

    def __post_init__(self):
        super().__post_init__()
        if (self.data.num_frames - 1) % 4:
            raise ValueError(f"data.num_frames must be 4k + 1 (1, 5, 9, ..., 81), got {self.data.num_frames}")


class SanaVideoTask(GemmaCaptions, WanTask):
    """:class:`WanTask` with SANA-Video's transformer, pipeline, text encoder (:class:`GemmaCaptions`) and
    sampling call; the latents are Wan's, normalised as ``SanaVideoPipeline`` decodes them."""

    base = SANA_VIDEO
    name = SANA_VIDEO.name

    def size_multiple(self, transformer: dict, vae: dict) -> tuple[int, str]:
        """Wan's; ``SanaVideoPipeline`` also wants heights and widths in multiples of 32, and the latents
        normalised with the Wan VAE's statistics (the only VAE this task encodes with)."""
        if "latents_mean" not in vae or "z_dim" not in vae:
            raise ConfigError(
                f"model.pretrained={self.cfg.model.pretrained!r}: this task encodes with a Wan VAE "
                "(AutoencoderKLWan, SANA-Video 480p); other VAEs are not supported"
            )
        spatial = vae.get("scale_factor_spatial", 8)
        _, ph, pw = transformer["patch_size"]
        return math.lcm(32, spatial * ph, spatial * pw), "SanaVideoPipeline needs multiples of 32"

    def _generate(self, pipe, prompts: list[str], seed: int) -> np.ndarray:
        """Videos ``(B, F, H, W, 3)`` in [0, 1] from ``pipe`` at the data's size."""
        d = self.cfg.data
        return np.asarray(
            pipe(
                prompt=prompts, height=d.height, width=d.width, frames=d.num_frames,
                num_inference_steps=self.cfg.log.sample_steps, guidance_scale=self.cfg.log.guidance_scale,
                generator=torch.Generator(pipe.transformer.device).manual_seed(seed),
                use_resolution_binning=False, complex_human_instruction=None,
                max_sequence_length=d.max_sequence_length, output_type="np",
            ).frames
        )

    def teacher_sample(self, pipe, prompt: str, seed: int) -> np.ndarray:
        """One video ``(F, H, W, 3)`` uint8."""
        frames = self._generate(pipe, [prompt], seed)[0]
        return (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)

    def generate_videos(self, transformer) -> np.ndarray:
        return self._generate(self.pipeline(transformer), list(self.cfg.data.sample_prompts), self.cfg.seed)
