"""Flow-matching fine-tuning of a pretrained Wan image-to-video checkpoint into MHLA
(``scripts/finetune_wan_i2v.py``), and the base task of its stage-1 conversion (``scripts/linearize.py --base
wan-i2v``).

Wan I2V is Wan's data, latents and text side, with the first frame of each training video as its condition,
exactly as ``WanImageToVideoPipeline`` builds it at sampling time: the VAE latents of the first frame followed
by zeros, behind 4 mask channels (``pipe.prepare_latents``), concatenated to the noisy latents on the channel
axis (16 + 4 + 16 = 36 input channels); Wan2.1 I2V also feeds the first frame's CLIP features
(``pipe.encode_image``) to the cross-attention. The condition is encoded once into the feature cache with the
rest. A Wan2.2 I2V-A14B run trains one expert (``model.expert``) on its own noise range, as for T2V.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from ..bases.wan_i2v import BASE as WAN_I2V
from .config import ConfigError
from .finetune import WanTask

CLIP_TEXT_TOKENS = 512  # diffusers' Wan I2V cross-attention splits the image tokens off at 512 text tokens


def first_frame_image(pixels: torch.Tensor) -> Image.Image:
    """The first frame of ``(3, F, H, W)`` pixels in [-1, 1], as the RGB image a user would pass."""
    frame = ((pixels[:, 0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return Image.fromarray(frame.permute(1, 2, 0).cpu().numpy())


class WanI2VTask(WanTask):
    """:class:`WanTask` conditioned on each video's first frame (and its CLIP features where the model has
    them), sampled through ``WanImageToVideoPipeline`` from the first frames of the data."""

    base = WAN_I2V
    name = WAN_I2V.name

    def validate(self) -> None:
        """Wan's checks, and: a data source with videos (no teacher data), an image-to-video transformer
        (not TI2V-5B's ``expand_timesteps``), 512 text tokens for a model with CLIP features."""
        source, pretrained = self.cfg.data.source, self.cfg.model.pretrained
        if source not in self.base.data_sources:  # teacher data would need an image per prompt
            raise ConfigError(
                f"data.source={source}: base {self.base.name} trains on videos whose first frames are the "
                f"conditions; use one of {list(self.base.data_sources)}"
            )
        super().validate()
        transformer = self.pretrained.transformer()
        if not self.base.matches(transformer):
            raise ConfigError(
                f"model.pretrained={pretrained!r}: its {self.cfg.model.expert} is not an "
                f"image-to-video Wan transformer (in_channels={transformer.get('in_channels')})"
            )
        if self.pretrained.index().get("expand_timesteps"):
            raise ConfigError(
                f"model.pretrained={pretrained!r} uses expand_timesteps (TI2V-5B): not supported by this task"
            )
        length = self.cfg.data.max_sequence_length
        if transformer.get("image_dim") is not None and length != CLIP_TEXT_TOKENS:
            raise ConfigError(
                f"data.max_sequence_length={length}: a Wan I2V model with CLIP image features "
                f"takes exactly {CLIP_TEXT_TOKENS} text tokens"
            )

    def encode_pixels(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Wan's latents, plus ``condition`` ``(4 + C, F', h, w)`` (mask, first-frame latents) and, for a
        model with CLIP, ``image_embeds`` ``(257, image_dim)``; at the item's own size (its bucket's)."""
        encoded = super().encode_pixels(pixels)
        pipe = self.frozen
        device = pipe.vae.device
        frames, height, width = pixels.shape[1:]
        first = pixels[:, 0][None].to(device, torch.float32)  # (1, 3, H, W) in [-1, 1]
        noise = torch.Generator(device).manual_seed(0)  # prepare_latents also draws latents: discarded
        _, condition = pipe.prepare_latents(
            first, 1, pipe.vae.config.z_dim, height, width, frames, torch.float32, device, noise
        )
        encoded["condition"] = condition[0].float()
        if pipe.image_encoder is not None:
            encoded["image_embeds"] = pipe.encode_image(first_frame_image(pixels), device)[0].float()
        return encoded

    def conditioning(self, batch: dict) -> dict:
        extra = {"encoder_hidden_states_image": batch["image_embeds"]} if "image_embeds" in batch else {}
        return {**super().conditioning(batch), **extra}

    def with_condition(self, inputs: dict, batch: dict) -> dict:
        """The condition concatenated to the noisy latents, as the pipeline does."""
        noisy = inputs["hidden_states"]
        return {**inputs, "hidden_states": torch.cat([noisy, batch["condition"].to(noisy)], dim=1)}

    def sample_conditions(self, count: int) -> list[Image.Image]:
        """The first frames of the first ``count`` training videos (cycled): the sample grid's images."""
        data = self.source.dataset()
        return [first_frame_image(data.load(i % len(data))["pixels"]) for i in range(count)]

    def generate_videos(self, transformer) -> np.ndarray:
        """``(B, F, H, W, 3)`` in [0, 1]: ``data.sample_prompts[i]`` from the first frame of video ``i``."""
        d = self.cfg.data
        pipe = self.pipeline(transformer, progress=True)
        images = self.sample_conditions(len(d.sample_prompts))
        return np.concatenate(
            [
                pipe(
                    image=image,
                    prompt=prompt,
                    height=d.height,
                    width=d.width,
                    num_frames=d.num_frames,
                    num_inference_steps=self.cfg.log.sample_steps,
                    guidance_scale=self.cfg.log.guidance_scale,
                    generator=torch.Generator(transformer.device).manual_seed(self.cfg.seed + i),
                    max_sequence_length=d.max_sequence_length,
                    output_type="np",
                ).frames
                for i, (prompt, image) in enumerate(zip(d.sample_prompts, images))
            ]
        )
