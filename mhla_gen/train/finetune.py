"""Flow-matching fine-tuning of pretrained SANA (images) and Wan2.1 (videos) into MHLA.

One :class:`TrainTask` for both; the differences are a few class attributes and two encode functions.
The frozen parts (text encoder, VAE) come from the checkpoint's own pipeline; every training item is
encoded once into a feature cache (latents + text embeddings, :func:`build_feature_cache`), so the
training loop only runs the transformer. Samples go through the stock ``SanaPipeline`` / ``WanPipeline``.
"""

from __future__ import annotations

import dataclasses
import functools
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

from ..bases import Base
from ..bases.sana import BASE as SANA
from ..bases.wan import BASE as WAN
from ..config import MHLAConfig
from ..data import CaptionedImageFolder, CaptionedVideoFolder
from ..data.latents import FEATURE_CACHE, check_cache_target
from ..folders import input_record
from ..install import stock_class_name
from ..lora import is_lora_folder, save_lora_mhla
from ..metrics.video import write_video
from .attention import attention_mhla_config, check_mhla_layers, install_attention, load_teacher
from .caption_data import CaptionFeatures
from .caption_sources import CAPTION_SOURCES
from .chunk_noise import FlowNoise, check_streaming
from .config import ConfigError
from .experts import check_expert, pipeline_with
from .loop import TrainTask, empty_model
from .objectives import flow_matching_mse
from .start import StartPoint

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _same_model(a: str, b: str) -> bool:
    """Two model references name the same thing: equal strings, or local paths to the same folder."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return a == b or (pa.exists() and pb.exists() and pa.resolve() == pb.resolve())


def log_teacher(cfg, teacher: str) -> None:
    """Say which distillation teacher a run uses, and warn when one ``model.init_from`` records is not
    ``model.pretrained``."""
    logger.info("distillation teacher: %s", teacher)
    if not cfg.train.distill.teacher and not _same_model(teacher, cfg.model.pretrained):
        logger.warning("distilling from the teacher model.init_from=%s converts (%s), not from "
                       "model.pretrained=%s", cfg.model.init_from, teacher, cfg.model.pretrained)


def pretrained_component_config(model_cfg, cls_name: str, subfolder: str | None) -> dict:
    """``config.json`` of a component of ``model.pretrained`` (``model_index.json`` for the pipeline class)
    read with diffusers' ``load_config`` (no weights); one-line errors naming the setting."""
    pretrained = model_cfg.pretrained
    local = Path(pretrained).expanduser()
    if (local.exists() or pretrained.startswith((".", "/", "~"))) and not local.is_dir():
        raise FileNotFoundError(f"model.pretrained={pretrained!r} is not a folder")
    try:
        return dict(getattr(diffusers, cls_name).load_config(pretrained, subfolder=subfolder,
                                                             revision=model_cfg.revision))
    except OSError as err:
        raise ConfigError(f"model.pretrained={pretrained!r}: {err}") from None


class FlowFinetuneTask(TrainTask):
    """Shared SANA / Wan fine-tuning. Subclasses name their base record (:attr:`base`: transformer and
    pipeline classes, video or image) and fill in the encoders and the sampling call."""

    base: Base

    def __init__(self, cfg):
        super().__init__(cfg)
        if not cfg.model.pretrained:
            raise ValueError("model.pretrained is required: a diffusers checkpoint folder or hub id")
        self.frozen = None  # setup(): the pipeline minus its transformer (text encoder, VAE, scheduler)
        self.features = CaptionFeatures(self)  # sizes, frames, cache, batches, flips, caption dropout
        self._raw = None  # the captioned dataset, listed once (validation counts it, the cache reads it)
        self.source = CAPTION_SOURCES[cfg.data.source](self)
        self.start = StartPoint.resolve(cfg.model.init_from)

    @property
    def transformer_cls(self) -> type:
        return self.base.transformer_class

    @property
    def pipeline_cls_name(self) -> str:
        return self.base.pipeline_class

    # ---------------------------------------------------------------------------------- model
    def signature(self) -> dict:
        attention, mhla = self.attention()
        mhla = attention_mhla_config(attention, mhla)
        return {
            "pretrained": self.cfg.model.pretrained,
            "attention": attention,
            "mhla": mhla.to_dict() if mhla is not None else None,
            "lora": self.lora_signature(),
            # likewise None without a start point (the key's name before model.init_from)
            "transformer": self.start.ref,
            "expert": None if self.cfg.model.expert == "transformer" else self.cfg.model.expert,
        }

    def attention(self) -> tuple[str, MHLAConfig]:
        """``(model.attention, mhla)`` this run trains: as configured, or the MHLA that
        ``model.init_from`` was saved with (``model.init_attention=saved``,
        see :meth:`StartPoint.attention`)."""
        m = self.cfg.model
        return self.start.attention(m.attention, self.cfg.mhla, m.init_attention)

    def run_config(self):
        """The config with the attention this run trains and the distillation teacher it uses (what
        ``config.yaml`` records)."""
        attention, mhla = self.attention()
        model = dataclasses.replace(self.cfg.model, attention=attention)
        train = self.cfg.train
        if train.distill.enabled:
            train = dataclasses.replace(train, distill=dataclasses.replace(train.distill,
                                                                           teacher=self.distill_source()))
        return dataclasses.replace(self.cfg, model=model, mhla=mhla, train=train)

    def distill_source(self) -> str:
        """``train.distill.teacher``, else what ``model.init_from`` converts (checked), else the base."""
        return self.cfg.train.distill.teacher or self.start.teacher() or self.cfg.model.pretrained

    def conversion_teacher(self) -> tuple[str, Path | None]:
        """``(reference, local transformer folder or None)`` of the model stage 1 converts: the start
        point, else ``model.pretrained``'s own transformer."""
        if self.start:
            return self.start.ref, self.start.folder
        folder = Path(self.cfg.model.pretrained) / self.cfg.model.expert
        return self.cfg.model.pretrained, folder if folder.is_dir() else None

    def architecture(self) -> nn.Module:
        return empty_model(self.transformer_cls, self._start_config() or self._transformer_config())

    def build_transformer(self) -> nn.Module:
        cls = self.transformer_cls
        m = self.cfg.model
        if self.start:  # a saved transformer to start from (e.g. a stage-1 folder)
            transformer = self.start.load(cls, *self.attention(), m.init_attention)
        else:
            transformer = cls.from_pretrained(
                m.pretrained, subfolder=self.cfg.model.expert, revision=m.revision, dtype=torch.float32
            )
            install_attention(transformer, m.attention, self.cfg.mhla)
        return self.with_lora(transformer)

    def save_final(self, transformer: nn.Module, folder: Path) -> None:
        """LoRA runs: adapter + MHLA parameters + the pretrained checkpoint's name (``load_transformer``
        rebuilds the model from the three); otherwise the whole transformer (``save_pretrained``)."""
        if self.cfg.train.trainable != "lora":
            return super().save_final(transformer, folder)
        m = self.cfg.model
        save_lora_mhla(transformer, folder, m.pretrained, subfolder=m.expert, revision=m.revision,
                       base_id=self.cfg.share.base_model)  # base_id: the hub id its manifest names

    def model_record(self) -> dict:
        """LoRA runs: the local base, resolved and fingerprinted, for ``final/``'s marker (never shared)."""
        lora = self.cfg.train.trainable == "lora"
        return {"base_record": input_record(self.cfg.model.pretrained)} if lora else {}

    def setup(self, accelerator) -> None:
        """The checkpoint's pipeline minus the transformer (tokenizer, text encoder, VAE, scheduler),
        frozen, in ``model.dtype`` on the device: it encodes the feature cache, gives the scheduler's
        shift and timesteps to the loss, and assembles the sampling pipeline."""
        cls = getattr(diffusers, self.pipeline_cls_name)
        pipe = cls.from_pretrained(
            self.cfg.model.pretrained,
            **{self.cfg.model.expert: None},  # a Wan2.2 expert's run keeps the other one (samples)
            revision=self.cfg.model.revision,
            dtype=DTYPES[self.cfg.model.dtype],
        )
        pipe.set_progress_bar_config(disable=True)
        self.frozen = pipe.to(accelerator.device)
        self.source.prepare(accelerator.device)

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
        return pretrained_component_config(self.cfg.model, cls_name, subfolder)

    def _transformer_config(self) -> dict:
        return self._component_config(self.transformer_cls.__name__, self.cfg.model.expert)

    def size_multiple(self, transformer: dict, vae: dict) -> tuple[int, str]:
        """``(multiple, why)``: what heights and widths must be multiples of (VAE, patch, pipeline)."""
        raise NotImplementedError

    def token_grid(self, transformer: dict, vae: dict, height: int, width: int) -> tuple[int, ...]:
        """The transformer's token grid for ``height x width`` pixels (and ``data.num_frames``); ConfigError
        when the frames do not tile."""
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
        check_expert(index, self.cfg.model.expert, self.cfg.model.pretrained)
        transformer, vae = self.model_configs()
        self.features.check_sizes(transformer, vae)
        check_mhla_layers(attention_mhla_config(*self.attention()), transformer["num_layers"])
        check_streaming(self, transformer)
        if self.cfg.train.distill.enabled:  # the log (and config.yaml, run_config) say which teacher
            log_teacher(self.cfg, self.distill_source())
        self.source.validate()
        check_cache_target(
            FEATURE_CACHE,
            self.cache_dir,
            "data.cache_dir",
            {"data.path": self.source.input_path(), "output_dir": self.cfg.output_dir},
            inside_ok=("output_dir",),
        )

    def model_configs(self) -> tuple[dict, dict]:
        """``(transformer config, VAE config)`` of the model trained (``model.init_from``'s or the
        checkpoint's transformer) and of the checkpoint's VAE: no weights."""
        index = self._component_config("DiffusionPipeline", None)
        transformer = self._start_config() or self._transformer_config()
        return transformer, self._component_config(index["vae"][1], "vae")

    def inputs(self) -> dict[str, str | None]:
        """Checkpoint, start point, data (an output when sampled from a teacher), prompts, cache, teacher."""
        m, data = self.cfg.model, self.cfg.data
        found = {"model.pretrained": m.pretrained, "model.init_from": m.init_from,
                 "data.path": self.source.input_path(),
                 "data.prompts_file": data.prompts_file, "data.cache_dir": data.cache_dir}
        if self.cfg.train.distill.enabled:
            found["train.distill.teacher"] = self.distill_source()
        return found

    def check_data(self) -> None:
        self.source.check_readable()  # at least one item reads (teacher samples: drawn later)

    def written_inside(self) -> tuple[str, ...]:
        """The cache (and data sampled from the teacher) may live in the run folder: the run writes them."""
        return ("data.cache_dir", "data.path") if self.cfg.data.source == "teacher" else ("data.cache_dir",)

    def depth(self) -> int:
        """Transformer blocks of the model trained (``model.init_from``'s or the checkpoint's)."""
        config = self._start_config() or self._transformer_config()
        return config["num_layers"]

    def _start_config(self) -> dict | None:
        """``model.init_from``'s ``config.json`` (None when unset): it must be a full transformer folder of
        this model family."""
        if not self.start:
            return None
        ref, folder = self.start.ref, self.start.folder or Path(self.start.ref)
        if is_lora_folder(folder):
            raise ConfigError(f"model.init_from={ref!r} is a LoRA folder; start from a full transformer "
                              f"folder, or from its base with train.trainable=lora")
        if not (folder / "config.json").is_file():
            raise ConfigError(f"model.init_from={ref!r} is not a transformer folder (no config.json)")
        loaded = json.loads((folder / "config.json").read_text())
        name = self.transformer_cls.__name__
        if stock_class_name(loaded.get("_class_name")) != name:
            raise ConfigError(f"model.init_from={ref!r} is a {loaded.get('_class_name')}, not a {name}")
        return loaded

    # ----------------------------------------------------------------------------------- data
    @property
    def cache_dir(self) -> Path:
        return Path(self.cfg.data.cache_dir or Path(self.cfg.output_dir) / "cache")

    def raw_dataset(self) -> Dataset:
        raise NotImplementedError

    def listed_dataset(self) -> Dataset:
        """:meth:`raw_dataset`, listed once (again after :meth:`forget_listing`)."""
        if self._raw is None:
            self._raw = self.raw_dataset()
        return self._raw

    def forget_listing(self) -> None:
        self._raw = None

    def count_items(self) -> int:
        return self.source.count_items()

    # ----------------------------------------------------------------------------- teacher data
    suffix = ".png"  # what a teacher sample is saved as

    def teacher_sample(self, pipe, prompt: str, seed: int):
        """One sample of ``prompt`` from ``pipe`` (``seed``), in the form :meth:`save_sample` writes."""
        raise NotImplementedError

    def save_sample(self, sample, path: Path) -> None:
        sample.save(path)

    def encode_pixels(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """One item's pixels ``(3, H, W)`` / ``(3, F, H, W)`` in [-1, 1] -> ``{"latents": (C, ...), ...}``:
        everything the cache holds that depends on the pixels."""
        raise NotImplementedError

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        """One caption -> ``{"prompt_embeds": (L, D), ...}`` as the pipeline encodes a prompt (the empty
        caption gives what its unconditional branch uses)."""
        raise NotImplementedError

    def build_dataset(self, accelerator) -> Dataset:
        """The feature cache (:meth:`CaptionFeatures.build`), encoded once with the task's encoders."""
        inputs = {"data.path": self.source.input_path(), "output_dir": self.cfg.output_dir}
        return self.features.build(self.listed_dataset(), self.cache_dir, inputs, accelerator.device)

    def batch_sampler(self, dataset, batch_size: int, processes: int, seed: int):
        return self.features.batch_sampler(dataset, batch_size, processes, seed)

    # ----------------------------------------------------------------------------------- loss
    def conditioning(self, batch: dict) -> dict:
        return {"encoder_hidden_states": batch["prompt_embeds"]}

    def with_condition(self, inputs: dict, batch: dict) -> dict:
        """The transformer's inputs with what the task adds from the batch (image-to-video: the condition)."""
        return inputs

    def model_inputs(self, batch: dict, rnd) -> tuple[dict, tuple]:
        """The transformer's keyword inputs for one micro-batch (latents noised at sampled σ, the cached
        text conditioning, flips and caption dropout applied) and what the loss compares its output with:
        ``(x0, noise, sigmas)``; ``sigmas`` ``(B,)``, or ``(B, chunks)`` with ``flow.per_chunk_noise``."""
        sigmas = self.noising.sigmas(rnd, batch["latents"])
        noise = rnd.randn(*batch["latents"].shape[1:])
        batch = self.features.augmented(batch, rnd)
        x0 = batch["latents"].float()
        inputs = {**self.noising.inputs(x0, noise, sigmas), **self.conditioning(batch)}
        return self.with_condition(inputs, batch), (x0, noise, sigmas)

    @functools.cached_property
    def noising(self) -> FlowNoise:
        """σ, noised inputs and loss weights of ``flow.*`` (``chunk_noise.py``; after :meth:`setup`)."""
        return FlowNoise.for_task(self)

    def loss(self, model, batch: dict, rnd) -> torch.Tensor:
        inputs, (x0, noise, sigmas) = self.model_inputs(batch, rnd)
        prediction = model(**inputs, return_dict=False)[0]
        weights = self.noising.loss_weights(sigmas)
        return flow_matching_mse(prediction, x0, noise, weights) + self.distillation(prediction, inputs)

    def distill_teacher(self) -> nn.Module:
        """``train.distill.teacher``, else ``model.pretrained``'s own transformer."""
        return load_teacher(self.transformer_cls, self.distill_source(), self.cfg.model.expert)

    # -------------------------------------------------------------------------------- samples
    def pipeline(self, transformer, progress: bool = False):
        return pipeline_with(self.frozen, self.cfg.model.expert, transformer, progress)


class SanaTask(FlowFinetuneTask):
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

    def raw_dataset(self) -> Dataset:
        d, listed = self.cfg.data, self.source.raw_dataset()  # hf / shards read by their source
        if listed is not None:
            return listed
        return CaptionedImageFolder(d.path, d.height, d.width, buckets=self.features.bucket_sizes())

    def encode_pixels(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        vae = self.frozen.vae
        latents = vae.encode(pixels[None].to(vae.device, vae.dtype)).latent  # DC-AE: deterministic
        return {"latents": (latents * vae.config.scaling_factor)[0].float()}

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
    base = WAN
    name = WAN.name
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

    def raw_dataset(self) -> Dataset:
        d, listed = self.cfg.data, self.source.raw_dataset()  # hf / shards read by their source
        if listed is not None:
            return listed
        features = self.features
        return CaptionedVideoFolder(d.path, d.num_frames, d.height, d.width, frames=features.frame_sampling(),
                                    buckets=features.bucket_sizes())

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
            from ..pipelines.wan_stream import stream_video

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
