"""SANA (images) and Wan2.1 / Wan2.2 (videos) fine-tuning into MHLA: the calls of their pipelines on top of
the one captioned task (:class:`~mhla_gen.train.captioned.CaptionedTask`: frozen pipeline, feature cache,
data sources, start point, the record's objective, which is flow matching for both). Samples go through the
stock ``SanaPipeline`` / ``WanPipeline``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

from ..bases.sana import BASE as SANA
from ..bases.wan import BASE as WAN
from ..pipelines.wan_stream import stream_video
from .captioned import CaptionedTask
from .config import ConfigError


class GemmaCaptions:
    """The caption side of SANA and SANA-Video tasks (a mixin before the task class): the pipeline's Gemma2
    features with their attention mask, and the transformer's conditioning from them."""

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        """Gemma2 features and attention mask, ``complex_human_instruction`` off (as SANA fine-tunes)."""
        pipe = self.frozen
        embeds, mask, _, _ = pipe.encode_prompt(
            caption,
            do_classifier_free_guidance=False,
            device=pipe.vae.device,
            complex_human_instruction=None,
            max_sequence_length=self.cfg.data.max_sequence_length,
        )
        return {"prompt_embeds": embeds[0].float(), "prompt_attention_mask": mask[0]}

    def conditioning(self, batch: dict) -> dict:
        return {
            "encoder_hidden_states": batch["prompt_embeds"],
            "encoder_attention_mask": batch["prompt_attention_mask"],
        }


class SanaTask(GemmaCaptions, CaptionedTask):
    base = SANA
    name = SANA.name

    def size_multiple(self, transformer: dict, vae: dict) -> tuple[int, str]:
        """DC-AE factor f x patch p; SanaPipeline also wants multiples of 32."""
        factor = 2 ** (len(vae["encoder_block_out_channels"]) - 1)
        patch = transformer["patch_size"]
        why = f"SanaPipeline needs multiples of 32; VAE {factor}x, patch {patch}"
        return math.lcm(32, factor * patch), why

    def token_grid(self, transformer: dict, vae: dict, height: int, width: int) -> tuple[int, ...]:
        """``(H / (f p), W / (f p))``: DC-AE factor f, patch p."""
        scale = 2 ** (len(vae["encoder_block_out_channels"]) - 1) * transformer["patch_size"]
        return height // scale, width // scale

    def encode_pixels(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        vae = self.frozen.vae
        latents = vae.encode(pixels[None].to(vae.device, vae.dtype)).latent  # DC-AE: deterministic
        return {"latents": (latents * vae.config.scaling_factor)[0].float()}

    def teacher_sample(self, pipe, prompt: str, seed: int):
        d = self.cfg.data
        return pipe(
            prompt=[prompt], height=d.height, width=d.width, num_inference_steps=self.cfg.log.sample_steps,
            guidance_scale=self.cfg.log.guidance_scale, use_resolution_binning=False,
            generator=torch.Generator(pipe.transformer.device).manual_seed(seed),
            complex_human_instruction=None, max_sequence_length=d.max_sequence_length,
        ).images[0]

    def sample_images(self, transformer) -> tuple[list, int]:
        data = self.cfg.data
        images = self.pipeline(transformer, progress=True)(
            prompt=list(data.sample_prompts),
            height=data.height,
            width=data.width,
            num_inference_steps=self.cfg.log.sample_steps,
            guidance_scale=self.cfg.log.guidance_scale,
            generator=torch.Generator(transformer.device).manual_seed(self.cfg.seed),
            use_resolution_binning=False,
            complex_human_instruction=None,
            max_sequence_length=data.max_sequence_length,
        ).images
        return images, len(images)


class WanTask(CaptionedTask):
    base = WAN
    name = WAN.name

    def teacher_sample(self, pipe, prompt: str, seed: int) -> np.ndarray:
        """One video ``(F, H, W, 3)`` uint8."""
        d = self.cfg.data
        frames = pipe(
            prompt=prompt, height=d.height, width=d.width, num_frames=d.num_frames,
            num_inference_steps=self.cfg.log.sample_steps, guidance_scale=self.cfg.log.guidance_scale,
            generator=torch.Generator(pipe.transformer.device).manual_seed(seed),
            max_sequence_length=d.max_sequence_length, output_type="np",
        ).frames[0]
        return (np.clip(np.asarray(frames), 0, 1) * 255).round().astype(np.uint8)

    def size_multiple(self, transformer: dict, vae: dict) -> tuple[int, str]:
        """The VAE's spatial factor x the patch; WanPipeline samples multiples of 16."""
        spatial = vae.get("scale_factor_spatial", 8)
        _, ph, pw = transformer["patch_size"]
        return (math.lcm(16, spatial * ph, spatial * pw),
                f"WanPipeline samples multiples of 16; VAE {spatial}x, patch {ph}x{pw}")

    def token_grid(self, transformer: dict, vae: dict, height: int, width: int) -> tuple[int, ...]:
        """``(F' / pt, H / (s ph), W / (s pw))``, ``F' = (F - 1) / t + 1`` latent frames (VAE t x s x s)."""
        spatial, temporal = vae.get("scale_factor_spatial", 8), vae.get("scale_factor_temporal", 4)
        pt, ph, pw = transformer["patch_size"]
        d = self.cfg.data
        if (d.num_frames - 1) % temporal or ((d.num_frames - 1) // temporal + 1) % pt:
            raise ConfigError(
                f"data.num_frames={d.num_frames} does not fit the VAE's {temporal}x temporal compression "
                f"and the temporal patch {pt}"
            )
        frames = (d.num_frames - 1) // temporal + 1
        return frames // pt, height // (spatial * ph), width // (spatial * pw)

    def encode_pixels(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Wan VAE latents of ``(3, F, H, W)``, normalised as the pipeline decodes them
        (``z = latents * std + mean``)."""
        vae = self.frozen.vae
        z = vae.encode(pixels[None].to(vae.device, vae.dtype)).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
        return {"latents": ((z.float() - mean) / std)[0]}

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        """UMT5 features, zero-padded to ``data.max_sequence_length`` as the pipeline pads them."""
        pipe = self.frozen
        embeds, _ = pipe.encode_prompt(
            caption,
            do_classifier_free_guidance=False,
            device=pipe.vae.device,
            max_sequence_length=self.cfg.data.max_sequence_length,
        )
        return {"prompt_embeds": embeds[0].float()}

    def generate_videos(self, transformer) -> np.ndarray:
        """``(B, F, H, W, 3)`` in [0, 1]: one video per ``data.sample_prompts`` entry; a block-causal model
        (``mhla.chunk_frames``) streams them chunk by chunk (``log.sample_steps`` per chunk)."""
        d = self.cfg.data
        if getattr(transformer, "mhla_config", None) is not None and transformer.mhla_config.chunk_frames:

            return stream_video(
                self.pipeline(transformer, progress=True), list(d.sample_prompts), num_frames=d.num_frames,
                height=d.height, width=d.width, num_inference_steps=self.cfg.log.sample_steps,
                guidance_scale=self.cfg.log.guidance_scale, max_sequence_length=d.max_sequence_length,
                generator=torch.Generator(transformer.device).manual_seed(self.cfg.seed), output_type="np",
            ).frames
        return self.pipeline(transformer, progress=True)(
            prompt=list(d.sample_prompts),
            height=d.height,
            width=d.width,
            num_frames=d.num_frames,
            num_inference_steps=self.cfg.log.sample_steps,
            guidance_scale=self.cfg.log.guidance_scale,
            generator=torch.Generator(transformer.device).manual_seed(self.cfg.seed),
            max_sequence_length=d.max_sequence_length,
            output_type="np",
        ).frames

    def sample_images(self, transformer) -> tuple[list, int]:
        """One row per prompt: up to 8 evenly spaced frames of the generated video."""
        frames = np.asarray(self.generate_videos(transformer))  # (B, F, H, W, 3) in [0, 1]
        pick = np.unique(np.linspace(0, frames.shape[1] - 1, min(8, frames.shape[1])).round().astype(int))
        images = [
            Image.fromarray((frames[b, f] * 255).round().astype(np.uint8))
            for b in range(frames.shape[0])
            for f in pick
        ]
        return images, len(pick)
