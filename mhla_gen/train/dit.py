"""DiT from scratch (or adapted from a pretrained softmax DiT): the task of scripts/train_dit.py.

Model: diffusers ``DiTTransformer2DModel`` with the DiT paper's sizes and adaLN-Zero init (``dit_model.py``);
attention is softmax, global linear (MHLA with one block) or MHLA. Objective: the record's, DDPM with learned
sigma (:class:`~mhla_gen.train.objectives.DDPM`, the ``diffusion`` section), CFG label dropout (done once per
sample here; see :func:`disable_block_label_dropout`), horizontal flips. Data: one
:class:`~mhla_gen.train.dit_sources.DiTSource` per ``data.source`` (class folders, a latent cache, the
digits, teacher samples). Start point: ``model.init_from``, resolved once
(:class:`~mhla_gen.train.start.StartPoint`). Samples come out of diffusers' ``DiTPipeline``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from diffusers import AutoencoderKL, DiTPipeline, DiTTransformer2DModel
from torch import nn
from torch.utils.data import Dataset

from ..bases.dit import BASE as DIT
from ..processors.config import MHLAConfig
from .attention import (
    attention_mhla_config,
    check_mhla_layers,
    check_teacher_loads,
    install_attention,
    load_teacher,
)
from .config import ConfigError, DiTRunConfig
from .dit_eval import digits_fid
from .dit_model import (  # noqa: F401 - DiT's model pieces, importable from here as before
    DIT_SIZES,
    PIPELINE_NULL_CLASS,
    IdentityVAE,
    check_blocks_fit,
    disable_block_label_dropout,
    dit_architecture,
    dit_init_config,
    dit_initialize_,
    identity_vae,
    label_table_size,
    make_sampler,
)
from .dit_sources import DiTSampling, dit_source
from .objectives import ModelFacts, objective_settings
from .start import StartPoint
from .task import TrainTask, empty_model

logger = logging.getLogger(__name__)


class DiTTask(TrainTask):
    base = DIT
    name = DIT.name
    fsdp_units = ("BasicTransformerBlock", "CombinedTimestepLabelEmbeddings")  # FSDP2 (train.distributed)
    fsdp_shared = ("CombinedTimestepLabelEmbeddings",)  # block 0's embedder: the forward calls it outside
    rebuilds_pipeline = True  # a run's config alone rebuilds its sampler (mhla_gen.train.runs)

    def __init__(self, cfg: DiTRunConfig):
        super().__init__(cfg)
        objective = self.base.objective.load()  # DDPM on the diffusion section's schedule
        facts = ModelFacts(learn_sigma=cfg.model.learn_sigma)
        self.objective = objective.build(objective_settings(objective, cfg), facts)
        self.vae = None  # the data's AutoencoderKL, frozen (setup); None in pixel space
        self.latent_scale = 1.0
        self.start = StartPoint.resolve(cfg.model.init_from)
        log = cfg.log
        sampling = DiTSampling(self.pipeline, cfg.diffusion.sampler, log.sample_steps, log.guidance_scale,
                               cfg.seed)
        self.source = dit_source(cfg.data, cfg.model.num_classes, self.start, sampling)

    @property
    def scheduler(self):
        """The training ``DDPMScheduler`` (the objective's); the sampling schedulers follow its config."""
        return self.objective.scheduler

    # ------------------------------------------------------------------------------ checks
    def validate(self) -> None:
        """The data source's own checks, resolution vs VAE and patch, MHLA blocks and layers vs the model,
        the start point and the distillation teacher."""
        m, data = self.cfg.model, self.cfg.data
        arch = dit_architecture(m)
        attention, mhla = self.attention()
        self.source.validate()
        channels, size = self.source.channels_and_size()
        if size % arch["patch_size"]:
            raise ConfigError(
                f"data.resolution={data.resolution} gives a {size}x{size} model input, which patch size "
                f"{arch['patch_size']} does not tile (model.patch_size / model.preset)"
            )
        mhla = attention_mhla_config(attention, mhla)
        check_blocks_fit(mhla, size // arch["patch_size"], data.resolution, arch["patch_size"])
        check_mhla_layers(mhla, self.depth())
        if self.start:
            self._check_start(channels, size)
        if self.cfg.train.distill.enabled:  # a loadable teacher; the log names it
            logger.info("distillation teacher: %s", self.distill_source())
            check_teacher_loads(DiTTransformer2DModel, self.distill_source())
        if self.cfg.eval.fid_num_samples and not self.source.scores_fid:
            raise ConfigError(
                f"eval.fid_num_samples={self.cfg.eval.fid_num_samples} is for data.source=digits only "
                f"(score other data with eval/generate.py + eval/fid.py); set it to 0"
            )

    def _check_start(self, channels: int, size: int) -> None:
        """``model.init_from`` must be a DiT whose input and label table fit the data."""
        config = self.start.config(DiTTransformer2DModel, "DiT transformer")
        got = (config.get("in_channels"), config.get("sample_size"), config.get("num_embeds_ada_norm"))
        need = (channels, size, label_table_size(self.cfg.model.num_classes))
        if got != need:
            raise ConfigError(
                f"model.init_from={self.start.ref!r} has (in_channels, sample_size, num_classes) = {got}, "
                f"the data/config need {need}"
            )

    # --------------------------------------------------------------------------- start point
    def depth(self) -> int:
        """Transformer blocks of the model trained: ``model.init_from``'s, else the configured size's."""
        if self.start:
            return self.start.config(DiTTransformer2DModel, "DiT transformer")["num_layers"]
        return dit_architecture(self.cfg.model)["depth"]

    def attention(self) -> tuple[str, MHLAConfig]:
        """``(model.attention, mhla)`` this run trains: as configured, or the MHLA that ``model.init_from``
        was saved with (``model.init_attention=saved``, see :meth:`StartPoint.attention`)."""
        m = self.cfg.model
        return self.start.attention(m.attention, self.cfg.mhla, m.init_attention)

    def run_config(self) -> DiTRunConfig:
        """The config with the attention this run trains and the teachers it uses (what ``config.yaml``
        records)."""
        attention, mhla = self.attention()
        cfg = self.cfg
        model = dataclasses.replace(cfg.model, attention=attention)
        data, train = self.source.run_settings(), cfg.train  # e.g. a latent cache's resolution, the teacher
        if train.distill.enabled:
            train = dataclasses.replace(train, distill=dataclasses.replace(train.distill,
                                                                           teacher=self.distill_source()))
        return dataclasses.replace(cfg, model=model, mhla=mhla, data=data, train=train)

    def inputs(self) -> dict[str, str | None]:
        """Start point, data (an output when sampled from a teacher), VAE and teachers."""
        found = {"model.init_from": self.cfg.model.init_from, **self.source.inputs()}
        if self.cfg.train.distill.enabled:
            found["train.distill.teacher"] = self.distill_source()
        return found

    def written_inside(self) -> tuple[str, ...]:
        return self.source.written_inside()  # teacher data: sampled by this run

    def distill_source(self) -> str:
        """``train.distill.teacher``, else the model ``model.init_from`` converts."""
        source = self.cfg.train.distill.teacher or self.start.teacher()
        if source is None:
            raise ConfigError(
                "train.distill needs a teacher: set train.distill.teacher=PATH (or start from a stock model "
                "or a stage-1 folder with model.init_from)"
            )
        return source

    def conversion_teacher(self) -> tuple[str, object]:
        """``(reference, local transformer folder or None)`` of the model stage 1 converts."""
        if not self.start:
            raise ConfigError("model.init_from is required: the pretrained DiT to convert (the teacher)")
        return self.start.ref, self.start.folder

    def distill_teacher(self) -> nn.Module:
        return load_teacher(DiTTransformer2DModel, self.distill_source())

    def count_items(self) -> int:
        return self.source.count_items()

    def signature(self) -> dict:
        channels, size = self.source.channels_and_size()
        attention, mhla = self.attention()
        return {
            "architecture": dit_architecture(self.cfg.model),
            "in_channels": channels,
            "sample_size": size,
            "num_classes": self.cfg.model.num_classes,
            "learn_sigma": self.cfg.model.learn_sigma,
            "attention": attention,
            "mhla": attention_mhla_config(attention, mhla).to_dict() if attention != "softmax" else None,
            "lora": self.lora_signature(),
        }

    def model_record(self) -> dict:
        """``num_classes``: the labels this model was trained on (sample.py and generate.py check them)."""
        return {"num_classes": self.cfg.model.num_classes}

    def architecture(self) -> nn.Module:
        fresh = lambda: dit_init_config(self.cfg.model, *self.source.channels_and_size())
        config = self.start.config(DiTTransformer2DModel, "DiT transformer") if self.start else fresh()
        return empty_model(DiTTransformer2DModel, config)

    def build_transformer(self) -> nn.Module:
        m = self.cfg.model
        channels, size = self.source.channels_and_size()
        if self.start:
            self._check_start(channels, size)
            transformer = self.start.load(DiTTransformer2DModel, *self.attention(), m.init_attention)
        else:
            transformer = DiTTransformer2DModel(**dit_init_config(m, channels, size))
            dit_initialize_(transformer)
            install_attention(transformer, m.attention, self.cfg.mhla)
        disable_block_label_dropout(transformer)
        return self.with_lora(transformer)  # final/ merges it (DiTPipeline has no LoRA loader)

    # ----------------------------------------------------------------------------------- data
    def setup(self, accelerator) -> None:
        """In latent space (``data.vae`` set, not digits): the data's ``AutoencoderKL``, frozen, on the
        device. It encodes class-folder images on the fly and decodes the sample grids. Then the source's
        own preparation (teacher samples)."""
        self.load_vae(accelerator.device)
        self.source.prepare(accelerator.device)

    def load_vae(self, device) -> None:
        """The data's ``AutoencoderKL`` (``data.vae``), frozen, on ``device``; nothing in pixel space."""
        data = self.cfg.data
        if data.vae is not None and not self.source.pixel_space:
            self.vae = AutoencoderKL.from_pretrained(data.vae, subfolder=data.vae_subfolder)
            self.vae.requires_grad_(False).eval().to(device)
            self.latent_scale = self.vae.config.scaling_factor

    def build_dataset(self, accelerator) -> Dataset:
        return self.source.dataset()

    def _clean_input(self, batch: dict, rnd) -> torch.Tensor:
        """x0 ``(B, C, h, w)``: flipped per sample (seeded), VAE-encoded when training in latent space."""
        flip = (rnd.rand() < 0.5) & self.cfg.data.hflip  # (B,) bool, drawn even when flips are off
        if "latents" in batch:  # cache holds [image, flipped image]
            pair = batch["latents"]
            return torch.where(flip.view(-1, 1, 1, 1), pair[:, 1], pair[:, 0])
        x = batch["pixels"]
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
        if self.vae is None:  # pixel space (the digits, or no data.vae)
            return x
        with torch.no_grad():
            dist = self.vae.encode(x.to(self.vae.dtype)).latent_dist
            z = dist.mean + dist.std * rnd.randn(*dist.mean.shape[1:]).to(dist.mean.dtype)
        return z.float() * self.latent_scale

    def model_inputs(self, batch: dict, rnd) -> tuple[dict, tuple]:
        """The transformer's keyword inputs for one micro-batch (noised at sampled timesteps, labels dropped
        for CFG) and the objective's target: ``(x0, xt, noise, t)``."""
        x0 = self._clean_input(batch, rnd)
        drop = rnd.rand() < self.cfg.model.class_dropout_prob
        labels = torch.where(drop, label_table_size(self.cfg.model.num_classes), batch["class_labels"])
        inputs, target = self.objective.noised(x0, self.objective.draw(rnd, x0))
        return {**inputs, "class_labels": labels}, target

    def loss(self, model, batch: dict, rnd) -> torch.Tensor:
        inputs, target = self.model_inputs(batch, rnd)
        out = model(**inputs, return_dict=False)[0]
        return self.objective.loss(out, target) + self.distillation(out, inputs)

    # -------------------------------------------------------------------------------- samples
    def pipeline(self, transformer):
        """``DiTPipeline`` around ``transformer``: the data's VAE (after :meth:`setup`; identity in pixel
        space) and the ``diffusion.sampler`` scheduler."""
        vae = self.vae if self.vae is not None else identity_vae()
        return DiTPipeline(transformer=transformer, vae=vae,
                           scheduler=make_sampler(self.cfg.diffusion.sampler, self.scheduler))

    @torch.no_grad()
    def generate(self, transformer, labels: list[int], seed: int, output_type: str = "pil", progress=False):
        pipe = self.pipeline(transformer)
        pipe.set_progress_bar_config(disable=not progress, desc="sample grid", leave=False)
        log, generator = self.cfg.log, torch.Generator(transformer.device).manual_seed(seed)
        return pipe(class_labels=labels, guidance_scale=log.guidance_scale, output_type=output_type,
                    num_inference_steps=log.sample_steps, generator=generator).images

    def sample_images(self, transformer) -> tuple[list, int]:
        """``num_samples`` per class for (up to) the first 10 classes: one row per class."""
        if self.vae is None and self.source.needs_decoder:  # (teacher data in pixel space decodes)
            logger.warning("no data.vae to decode latents with: sample grids skipped")
            return [], 1
        classes = min(self.cfg.model.num_classes, 10)
        per_class = max(1, self.cfg.log.num_samples)
        labels = [c for c in range(classes) for _ in range(per_class)]
        return self.generate(transformer, labels, seed=self.cfg.seed, progress=True), per_class

    def finish(self, transformer, accelerator) -> dict:
        """FID (digits feature extractor) between generated and real digits, for the digits source."""
        ev = self.cfg.eval
        if ev.fid_num_samples <= 0 or not self.source.scores_fid:  # validate() refused the latter
            return {}
        generate = lambda labels, seed: self.generate(transformer, labels, seed=seed, output_type="pt")
        return digits_fid(generate, self.cfg.model.num_classes, self.cfg.data.resolution, ev.fid_num_samples,
                          ev.fid_batch_size, self.cfg.seed)
