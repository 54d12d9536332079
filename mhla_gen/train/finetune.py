"""Flow-matching fine-tuning of pretrained SANA (images) and Wan2.1 (videos) into MHLA.

One :class:`TrainTask` for both; the differences are a few class attributes and two encode functions.
The frozen parts (text encoder, VAE) come from the checkpoint's own pipeline; every training item is
encoded once into a feature cache (latents + text embeddings, :func:`build_feature_cache`), so the
training loop only runs the transformer. Samples go through the stock ``SanaPipeline`` / ``WanPipeline``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import diffusers
import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset

from ..config import MHLAConfig
from ..data import CaptionedImageFolder, CaptionedVideoFolder, FeatureCacheDataset, build_feature_cache
from ..data.hf_datasets import HFCaptionedImages, HFCaptionedVideos
from ..data.images import require_dir
from ..data.latents import FEATURE_CACHE, check_cache_target
from ..data.shards import TarShardDataset, input_folder
from ..data.teacher import TEACHER_DATA, read_prompts, write_teacher_captioned
from ..folders import owned
from ..lora import add_lora, is_lora_folder, save_lora_mhla
from ..metrics.video import write_video
from .attention import (
    attention_mhla_config,
    check_mhla_layers,
    install_attention,
    load_start_transformer,
    load_teacher,
    start_attention,
)
from .config import ConfigError
from .loop import TrainTask
from .objectives import flow_matching_inputs, flow_matching_mse, flow_matching_sigmas

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
        self.frozen = None  # setup(): the pipeline minus its transformer (text encoder, VAE, scheduler)
        self._raw = None  # the captioned dataset, listed once (validation counts it, the cache reads it)

    # ---------------------------------------------------------------------------------- model
    def signature(self) -> dict:
        attention, mhla = self.attention()
        mhla = attention_mhla_config(attention, mhla)
        tc = self.cfg.train
        return {
            "pretrained": self.cfg.model.pretrained,
            "attention": attention,
            "mhla": mhla.to_dict() if mhla is not None else None,
            # None (not absent) otherwise, so checkpoints written before LoRA existed still match
            "lora": {"rank": tc.lora_rank, "alpha": tc.lora_alpha} if tc.trainable == "lora" else None,
            "transformer": self.cfg.model.transformer,  # likewise None before model.transformer existed
        }

    def attention(self) -> tuple[str, MHLAConfig]:
        """``(model.attention, mhla)`` this run trains: as configured, or the MHLA that
        ``model.transformer`` was saved with (``model.init_attention=saved``, see :func:`start_attention`)."""
        m = self.cfg.model
        folder = m.transformer
        return start_attention(m.attention, self.cfg.mhla, folder, m.init_attention, "model.transformer")

    def build_transformer(self) -> nn.Module:
        cls = getattr(diffusers, self.transformer_cls_name)
        m = self.cfg.model
        if m.transformer is not None:  # a saved transformer to start from (e.g. a stage-1 folder)
            attention, mhla = self.attention()
            transformer = load_start_transformer(cls, m.transformer, attention, mhla, m.init_attention)
        else:
            transformer = cls.from_pretrained(
                m.pretrained, subfolder="transformer", revision=m.revision, dtype=torch.float32
            )
            install_attention(transformer, m.attention, self.cfg.mhla)
        if self.cfg.train.trainable == "lora":  # adapter on to_q/k/v/out.0, MHLA parameters kept trainable
            add_lora(transformer, self.cfg.train.lora_rank, self.cfg.train.lora_alpha)
        return transformer

    def save_final(self, transformer: nn.Module, folder: Path) -> None:
        """LoRA runs: adapter + MHLA parameters + the pretrained checkpoint's name (``load_transformer``
        rebuilds the model from the three); otherwise the whole transformer (``save_pretrained``)."""
        if self.cfg.train.trainable != "lora":
            return super().save_final(transformer, folder)
        save_lora_mhla(
            transformer,
            folder,
            self.cfg.model.pretrained,
            subfolder="transformer",
            revision=self.cfg.model.revision,
        )

    def setup(self, accelerator) -> None:
        """The checkpoint's pipeline minus the transformer (tokenizer, text encoder, VAE, scheduler),
        frozen, in ``model.dtype`` on the device: it encodes the feature cache, gives the scheduler's
        shift and timesteps to the loss, and assembles the sampling pipeline."""
        cls = getattr(diffusers, self.pipeline_cls_name)
        pipe = cls.from_pretrained(
            self.cfg.model.pretrained,
            transformer=None,
            revision=self.cfg.model.revision,
            dtype=DTYPES[self.cfg.model.dtype],
        )
        pipe.set_progress_bar_config(disable=True)
        self.frozen = pipe.to(accelerator.device)
        if self.cfg.data.source == "teacher":
            self._sample_teacher(accelerator.device)

    @property
    def shift(self) -> float:
        """``flow.shift``, else the checkpoint scheduler's (after :meth:`setup`)."""
        if self.cfg.flow.shift is not None:
            return self.cfg.flow.shift
        config = self.frozen.scheduler.config
        return float(config.get("shift", None) or config.get("flow_shift", None) or 1.0)

    # --------------------------------------------------------------------------------- checks
    def _component_config(self, cls_name: str, subfolder: str | None) -> dict:
        """``config.json`` (``model_index.json`` for the pipeline) of ``model.pretrained``, no weights."""
        pretrained = self.cfg.model.pretrained
        local = Path(pretrained).expanduser()
        if (local.exists() or pretrained.startswith((".", "/", "~"))) and not local.is_dir():
            raise FileNotFoundError(f"model.pretrained={pretrained!r} is not a folder")
        try:
            return dict(
                getattr(diffusers, cls_name).load_config(
                    pretrained, subfolder=subfolder, revision=self.cfg.model.revision
                )
            )
        except OSError as err:
            raise ConfigError(f"model.pretrained={pretrained!r}: {err}") from None

    def token_grid(self, transformer: dict, vae: dict) -> tuple[int, ...]:
        """The transformer's token grid for ``data.*`` sizes; ConfigError when they do not tile."""
        raise NotImplementedError

    def validate(self) -> None:
        """Checkpoint family, sizes vs VAE / patch / pipeline, MHLA blocks vs the token grid, data and
        cache folders: all before the pipeline is loaded or any item is encoded."""
        index = self._component_config("DiffusionPipeline", None)
        if index.get("_class_name") != self.pipeline_cls_name:
            raise ConfigError(
                f"model.pretrained={self.cfg.model.pretrained!r} is a {index.get('_class_name')} checkpoint, "
                f"not a {self.pipeline_cls_name} (wrong script for this model?)"
            )
        transformer = self._start_config() or self._component_config(self.transformer_cls_name, "transformer")
        vae = self._component_config(index["vae"][1], "vae")
        grid = self.token_grid(transformer, vae)
        self.cfg.model.attention, self.cfg.mhla = self.attention()  # config.yaml records what the run trains
        mhla = attention_mhla_config(self.cfg.model.attention, self.cfg.mhla)
        fits = mhla is None or (len(mhla.blocks) == len(grid) and all(map(int.__le__, mhla.blocks, grid)))
        if not fits:
            raise ConfigError(
                f"mhla.blocks={list(mhla.blocks)} does not fit the token grid {grid} of data.height="
                f"{self.cfg.data.height}, data.width={self.cfg.data.width}"
                + (f", data.num_frames={self.cfg.data.num_frames}" if len(grid) == 3 else "")
            )
        check_mhla_layers(mhla, transformer["num_layers"])
        data = self.cfg.data
        if data.source == "teacher":  # data.path is sampled at setup: it must be ours to write
            owned(data.path, TEACHER_DATA, "data.path")
            read_prompts(data.prompts_file)
        elif data.source == "folder":  # hf / shards: listed (and checked) by count_items, before any work
            require_dir(data.path, "data.path")
        check_cache_target(
            FEATURE_CACHE,
            self.cache_dir,
            "data.cache_dir",
            {"data.path": input_folder(data.path), "output_dir": self.cfg.output_dir},
            inside_ok=("output_dir",),
        )

    def depth(self) -> int:
        """Transformer blocks of the model trained (``model.transformer``'s or the checkpoint's)."""
        config = self._start_config() or self._component_config(self.transformer_cls_name, "transformer")
        return config["num_layers"]

    def _start_config(self) -> dict | None:
        """``model.transformer``'s ``config.json`` (None when unset): it must be a full transformer folder of
        this model family."""
        folder = self.cfg.model.transformer
        if folder is None:
            return None
        config = Path(folder) / "config.json"
        if is_lora_folder(folder):
            raise ConfigError(f"model.transformer={folder!r} is a LoRA folder; start from a full transformer "
                              f"folder, or from its base with train.trainable=lora")
        if not config.is_file():
            raise ConfigError(f"model.transformer={folder!r} is not a transformer folder (no config.json)")
        loaded = json.loads(config.read_text())
        if loaded.get("_class_name") != self.transformer_cls_name:
            raise ConfigError(f"model.transformer={folder!r} is a {loaded.get('_class_name')}, not a "
                              f"{self.transformer_cls_name}")
        return loaded

    def _check_multiple(self, multiple: int, why: str) -> None:
        for name in ("height", "width"):
            value = getattr(self.cfg.data, name)
            if value % multiple:
                raise ConfigError(f"data.{name}={value} must be a multiple of {multiple} ({why})")

    # ----------------------------------------------------------------------------------- data
    @property
    def cache_dir(self) -> Path:
        return Path(self.cfg.data.cache_dir or Path(self.cfg.output_dir) / "cache")

    def raw_dataset(self) -> Dataset:
        raise NotImplementedError

    def listed_dataset(self) -> Dataset:
        """:meth:`raw_dataset`, listed once."""
        if self._raw is None:
            self._raw = self.raw_dataset()
        return self._raw

    def count_items(self) -> int:
        if self.cfg.data.source == "teacher":  # not sampled yet
            return self.cfg.data.teacher_samples
        return len(self.listed_dataset())

    # ----------------------------------------------------------------------------- teacher data
    suffix = ".png"  # what a teacher sample is saved as

    def teacher_sample(self, pipe, prompt: str, seed: int):
        """One sample of ``prompt`` from ``pipe`` (``seed``), in the form :meth:`save_sample` writes."""
        raise NotImplementedError

    def save_sample(self, sample, path: Path) -> None:
        sample.save(path)

    def _sample_teacher(self, device) -> None:
        """``data.teacher_samples`` samples of the prompts from ``model.pretrained`` (its own transformer and
        stock pipeline) into ``data.path``, resumable (:func:`write_teacher_captioned`)."""
        d, m = self.cfg.data, self.cfg.model
        teacher = getattr(diffusers, self.transformer_cls_name).from_pretrained(
            m.pretrained, subfolder="transformer", revision=m.revision, dtype=DTYPES[m.dtype]
        )
        pipe = self.pipeline(teacher.to(device))
        fingerprint = {
            "pretrained": m.pretrained, "prompts": read_prompts(d.prompts_file), "count": d.teacher_samples,
            "size": [d.height, d.width, d.num_frames if self.name == "wan" else 1],
            "steps": self.cfg.log.sample_steps, "guidance": self.cfg.log.guidance_scale,
            "seed": self.cfg.seed,
        }
        sample = lambda prompt, i: self.teacher_sample(pipe, prompt, self.cfg.seed * 100_003 + i)
        prompts = fingerprint["prompts"]
        write_teacher_captioned(sample, self.save_sample, d.path, prompts, d.teacher_samples, self.suffix,
                                fingerprint)
        self._raw = None  # listed again, with the samples

    def encode(self, item: dict) -> dict[str, torch.Tensor]:
        """One raw item -> ``{"latents": (C, ...), "prompt_embeds": (L, D), ...}`` for the cache."""
        raise NotImplementedError

    def build_dataset(self, accelerator) -> Dataset:
        """The feature cache of every item (encoded once with :meth:`encode`, reused when its
        fingerprint matches)."""
        data = self.cfg.data
        cache_dir = self.cache_dir
        raw = self.listed_dataset()
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
        inputs = {"data.path": input_folder(data.path), "output_dir": self.cfg.output_dir}
        build_feature_cache(
            raw, self.encode, cache_dir, fingerprint, "data.cache_dir", inputs, inside_ok=("output_dir",)
        )
        return FeatureCacheDataset(cache_dir)

    # ----------------------------------------------------------------------------------- loss
    def conditioning(self, batch: dict) -> dict:
        return {"encoder_hidden_states": batch["prompt_embeds"]}

    def model_inputs(self, batch: dict, rnd) -> tuple[dict, tuple]:
        """The transformer's keyword inputs for one micro-batch (latents noised at sampled σ, the cached
        text conditioning) and what the loss compares its output with: ``(x0, noise)``."""
        x0 = batch["latents"].float()
        f = self.cfg.flow
        sigmas = flow_matching_sigmas(rnd, f.weighting, f.logit_mean, f.logit_std, f.mode_scale, self.shift)
        noise = rnd.randn(*x0.shape[1:])
        T = self.frozen.scheduler.config.num_train_timesteps
        return {**flow_matching_inputs(x0, noise, sigmas, T), **self.conditioning(batch)}, (x0, noise)

    def loss(self, model, batch: dict, rnd) -> torch.Tensor:
        inputs, (x0, noise) = self.model_inputs(batch, rnd)
        prediction = model(**inputs, return_dict=False)[0]
        return flow_matching_mse(prediction, x0, noise) + self.distillation(prediction, inputs)

    def distill_teacher(self) -> nn.Module:
        """``train.distill.teacher``, else ``model.pretrained``'s own transformer."""
        cls = getattr(diffusers, self.transformer_cls_name)
        return load_teacher(cls, self.cfg.train.distill.teacher or self.cfg.model.pretrained)

    # -------------------------------------------------------------------------------- samples
    def pipeline(self, transformer, progress: bool = False):
        cls = type(self.frozen)
        pipe = cls(**{**self.frozen.components, "transformer": transformer})
        pipe.set_progress_bar_config(disable=not progress, desc="sample grid", leave=False)
        return pipe


class SanaTask(FlowFinetuneTask):
    name = "sana"
    pipeline_cls_name = "SanaPipeline"
    transformer_cls_name = "SanaTransformer2DModel"

    def token_grid(self, transformer: dict, vae: dict) -> tuple[int, ...]:
        """``(H / (f p), W / (f p))``: DC-AE factor f, patch p; SanaPipeline also wants multiples of 32."""
        factor = 2 ** (len(vae["encoder_block_out_channels"]) - 1)
        patch = transformer["patch_size"]
        self._check_multiple(
            math.lcm(32, factor * patch), f"SanaPipeline needs multiples of 32; VAE {factor}x, patch {patch}"
        )
        d = self.cfg.data
        return d.height // (factor * patch), d.width // (factor * patch)

    def raw_dataset(self) -> Dataset:
        d = self.cfg.data
        if d.source == "hf":
            return HFCaptionedImages(d.path, d.split, d.image_column, d.caption_column, d.height, d.width)
        if d.source == "shards":
            return TarShardDataset(d.path, d.height, d.width)
        return CaptionedImageFolder(d.path, d.height, d.width)

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


class WanTask(FlowFinetuneTask):
    name = "wan"
    pipeline_cls_name = "WanPipeline"
    transformer_cls_name = "WanTransformer3DModel"
    suffix = ".mp4"

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

    def save_sample(self, sample: np.ndarray, path: Path) -> None:
        write_video(path, sample, fps=16, lossless=True)

    def token_grid(self, transformer: dict, vae: dict) -> tuple[int, ...]:
        """``(F' / pt, H / (s ph), W / (s pw))``, ``F' = (F - 1) / t + 1`` latent frames (VAE t x s x s)."""
        spatial, temporal = vae.get("scale_factor_spatial", 8), vae.get("scale_factor_temporal", 4)
        pt, ph, pw = transformer["patch_size"]
        self._check_multiple(
            math.lcm(16, spatial * ph, spatial * pw),
            f"WanPipeline samples multiples of 16; VAE {spatial}x, patch {ph}x{pw}",
        )
        d = self.cfg.data
        if (d.num_frames - 1) % temporal or ((d.num_frames - 1) // temporal + 1) % pt:
            raise ConfigError(
                f"data.num_frames={d.num_frames} does not fit the VAE's {temporal}x temporal compression "
                f"and the temporal patch {pt}"
            )
        frames = (d.num_frames - 1) // temporal + 1
        return frames // pt, d.height // (spatial * ph), d.width // (spatial * pw)

    def raw_dataset(self) -> Dataset:
        d = self.cfg.data
        if d.source == "hf":
            columns = d.video_column, d.caption_column
            return HFCaptionedVideos(d.path, d.split, *columns, d.num_frames, d.height, d.width)
        if d.source == "shards":
            return TarShardDataset(d.path, d.height, d.width, num_frames=d.num_frames)
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
        d = self.cfg.data
        frames = self.pipeline(transformer, progress=True)(
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
