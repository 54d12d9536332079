"""Flow-matching fine-tuning of pretrained SANA (images) and Wan2.1 (videos) into MHLA.

One :class:`TrainTask` for both; the differences are a few class attributes and two encode functions.
The frozen parts (text encoder, VAE) come from the checkpoint's own pipeline; every training item is
encoded once into a feature cache (latents + text embeddings, :func:`build_feature_cache`), so the
training loop only runs the transformer. Samples go through the stock ``SanaPipeline`` / ``WanPipeline``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from .dit import attention_mhla_config, install_attention
from .loop import TrainTask
from .objectives import flow_matching_loss, flow_matching_sigmas

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FlowFinetuneTask(TrainTask):
    """Shared SANA / Wan fine-tuning. Subclasses set the pipeline/transformer classes and the encoders."""

    pipeline_cls_name = ""
    transformer_cls_name = ""

    def __init__(self, cfg):
        super().__init__(cfg)
        if not cfg.model.pretrained:
            raise ValueError("model.pretrained is required: a diffusers checkpoint folder or hub id")
        self.frozen = None  # the pipeline without its transformer: tokenizer, text encoder, VAE, scheduler

    # ---------------------------------------------------------------------------------- model
    def signature(self) -> dict:
        mhla = attention_mhla_config(self.cfg.model.attention, self.cfg.mhla)
        tc = self.cfg.train
        return {
            "pretrained": self.cfg.model.pretrained,
            "attention": self.cfg.model.attention,
            "mhla": mhla.to_dict() if mhla is not None else None,
            # None (not absent) otherwise, so checkpoints written before LoRA existed still match
            "lora": {"rank": tc.lora_rank, "alpha": tc.lora_alpha} if tc.trainable == "lora" else None,
        }

    def build_transformer(self) -> nn.Module:
        import diffusers

        cls = getattr(diffusers, self.transformer_cls_name)
        transformer = cls.from_pretrained(
            self.cfg.model.pretrained,
            subfolder="transformer",
            revision=self.cfg.model.revision,
            dtype=torch.float32,
        )
        install_attention(transformer, self.cfg.model.attention, self.cfg.mhla)
        if self.cfg.train.trainable == "lora":  # adapter on to_q/k/v/out.0, MHLA parameters kept trainable
            from ..lora import add_lora

            add_lora(transformer, self.cfg.train.lora_rank, self.cfg.train.lora_alpha)
        return transformer

    def save_final(self, transformer: nn.Module, folder: Path) -> None:
        """LoRA runs: adapter + MHLA parameters + the pretrained checkpoint's name (``load_transformer``
        rebuilds the model from the three); otherwise the whole transformer (``save_pretrained``)."""
        if self.cfg.train.trainable != "lora":
            return super().save_final(transformer, folder)
        from ..lora import save_lora_mhla

        save_lora_mhla(
            transformer,
            folder,
            self.cfg.model.pretrained,
            subfolder="transformer",
            revision=self.cfg.model.revision,
        )

    def frozen_pipeline(self, device):
        """The checkpoint's pipeline minus the transformer, frozen, in ``model.dtype`` on ``device``."""
        if self.frozen is None:
            import diffusers

            cls = getattr(diffusers, self.pipeline_cls_name)
            pipe = cls.from_pretrained(
                self.cfg.model.pretrained,
                transformer=None,
                revision=self.cfg.model.revision,
                dtype=DTYPES[self.cfg.model.dtype],
            )
            pipe.set_progress_bar_config(disable=True)
            self.frozen = pipe.to(device)
        return self.frozen

    @property
    def shift(self) -> float:
        if self.cfg.flow.shift is not None:
            return self.cfg.flow.shift
        config = self.frozen.scheduler.config
        return float(config.get("shift", None) or config.get("flow_shift", None) or 1.0)

    # ----------------------------------------------------------------------------------- data
    def raw_dataset(self) -> Dataset:
        raise NotImplementedError

    def encode(self, item: dict) -> dict[str, torch.Tensor]:
        """One raw item -> ``{"latents": (C, ...), "prompt_embeds": (L, D), ...}`` for the cache."""
        raise NotImplementedError

    def build_dataset(self, accelerator) -> Dataset:
        from ..data import FeatureCacheDataset, build_feature_cache

        data = self.cfg.data
        self.frozen_pipeline(accelerator.device)
        cache_dir = Path(data.cache_dir or Path(self.cfg.output_dir) / "cache")
        raw = self.raw_dataset()
        fingerprint = {
            "task": self.name,
            "pretrained": self.cfg.model.pretrained,
            "dtype": self.cfg.model.dtype,
            "files": [str(p) for p in raw.paths],
            "height": data.height,
            "width": data.width,
            "num_frames": data.num_frames if self.name == "wan" else None,
            "max_sequence_length": data.max_sequence_length,
        }
        build_feature_cache(raw, self.encode, cache_dir, fingerprint)
        return FeatureCacheDataset(cache_dir)

    # ----------------------------------------------------------------------------------- loss
    def conditioning(self, batch: dict) -> dict:
        return {"encoder_hidden_states": batch["prompt_embeds"]}

    def loss(self, model, batch: dict, rnd) -> torch.Tensor:
        x0 = batch["latents"].float()
        f = self.cfg.flow
        sigmas = flow_matching_sigmas(rnd, f.weighting, f.logit_mean, f.logit_std, f.mode_scale, self.shift)
        noise = rnd.randn(*x0.shape[1:])
        T = self.frozen.scheduler.config.num_train_timesteps
        return flow_matching_loss(model, x0, noise, sigmas, T, **self.conditioning(batch))

    # -------------------------------------------------------------------------------- samples
    def pipeline(self, transformer):
        cls = type(self.frozen)
        pipe = cls(**{**self.frozen.components, "transformer": transformer})
        pipe.set_progress_bar_config(disable=True)
        return pipe


class SanaTask(FlowFinetuneTask):
    name = "sana"
    pipeline_cls_name = "SanaPipeline"
    transformer_cls_name = "SanaTransformer2DModel"

    def raw_dataset(self) -> Dataset:
        from ..data import CaptionedImageFolder

        return CaptionedImageFolder(self.cfg.data.path, self.cfg.data.height, self.cfg.data.width)

    def encode(self, item: dict) -> dict[str, torch.Tensor]:
        pipe = self.frozen
        pixels = item["pixels"][None].to(pipe.vae.device, pipe.vae.dtype)
        latents = pipe.vae.encode(pixels).latent * pipe.vae.config.scaling_factor  # DC-AE: deterministic
        embeds, mask, _, _ = pipe.encode_prompt(
            item["caption"],
            do_classifier_free_guidance=False,
            device=pipe.vae.device,
            complex_human_instruction=None,
            max_sequence_length=self.cfg.data.max_sequence_length,
        )
        return {
            "latents": latents[0].float(),
            "prompt_embeds": embeds[0].float(),
            "prompt_attention_mask": mask[0],
        }

    def conditioning(self, batch: dict) -> dict:
        return {
            "encoder_hidden_states": batch["prompt_embeds"],
            "encoder_attention_mask": batch["prompt_attention_mask"],
        }

    def sample_images(self, transformer) -> tuple[list, int]:
        data = self.cfg.data
        images = self.pipeline(transformer)(
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


class WanTask(FlowFinetuneTask):
    name = "wan"
    pipeline_cls_name = "WanPipeline"
    transformer_cls_name = "WanTransformer3DModel"

    def raw_dataset(self) -> Dataset:
        from ..data import CaptionedVideoFolder

        d = self.cfg.data
        return CaptionedVideoFolder(d.path, d.num_frames, d.height, d.width)

    def encode(self, item: dict) -> dict[str, torch.Tensor]:
        pipe = self.frozen
        vae = pipe.vae
        video = item["pixels"][None].to(vae.device, vae.dtype)  # (1, 3, F, H, W) in [-1, 1]
        z = vae.encode(video).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
        latents = (z.float() - mean) / std  # WanPipeline decodes with z = latents * std + mean
        embeds, _ = pipe.encode_prompt(
            item["caption"],
            do_classifier_free_guidance=False,
            device=vae.device,
            max_sequence_length=self.cfg.data.max_sequence_length,
        )
        return {"latents": latents[0], "prompt_embeds": embeds[0].float()}

    def sample_images(self, transformer) -> tuple[list, int]:
        """One row per prompt: up to 8 evenly spaced frames of the generated video."""
        from PIL import Image

        d = self.cfg.data
        frames = self.pipeline(transformer)(
            prompt=list(d.sample_prompts),
            height=d.height,
            width=d.width,
            num_frames=d.num_frames,
            num_inference_steps=self.cfg.log.sample_steps,
            guidance_scale=self.cfg.log.guidance_scale,
            generator=torch.Generator(transformer.device).manual_seed(self.cfg.seed),
            max_sequence_length=d.max_sequence_length,
            output_type="np",
        ).frames  # (B, F, H, W, 3) in [0, 1]
        frames = np.asarray(frames)
        pick = np.unique(np.linspace(0, frames.shape[1] - 1, min(8, frames.shape[1])).round().astype(int))
        images = [
            Image.fromarray((frames[b, f] * 255).round().astype(np.uint8))
            for b in range(frames.shape[0])
            for f in pick
        ]
        return images, len(pick)
