"""Fine-tuning a pretrained captioned diffusers checkpoint into MHLA: the one task of SANA, Wan, SANA-Video,
Wan I2V and any captioned base (:class:`CaptionedTask`).

The frozen parts (text encoder, VAE, scheduler) come from the checkpoint's own pipeline; every training item
is encoded once into a feature cache (latents + text embeddings, :class:`~.caption_data.CaptionFeatures`),
so the training loop only runs the transformer. The data come from a source built from what it reads
(:mod:`.caption_sources`); the loss is the base record's objective (``Base.objective``: DDPM or flow
matching, :mod:`.objectives`), built from its run-config section; the run starts from ``model.pretrained``
or ``model.init_from`` (:class:`~.start.StartPoint`). A base adds only its own calls: how its pipeline
encodes pixels and captions, how the transformer takes the conditioning, how it samples, and the sizes
its VAE and patch tile.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..data.latents import FEATURE_CACHE, check_cache_target
from .attention import attention_mhla_config, check_mhla_layers
from .caption_data import CaptionFeatures, Items, check_sizes
from .caption_sources import CaptionSource, TeacherSampling, caption_source
from .config import ConfigError
from .objectives import ModelFacts, Objective, objective_settings
from .pretrained import PretrainedTask, log_teacher


class CaptionedTask(PretrainedTask):
    """Captioned fine-tuning with the base record's objective. Subclasses name their record (:attr:`base`)
    and fill in the calls of their pipeline: :meth:`size_multiple`, :meth:`token_grid`,
    :meth:`encode_pixels`, :meth:`encode_text`, :meth:`conditioning`, :meth:`teacher_sample` and
    :meth:`sample_images`."""

    # ----------------------------------------------------------------------- parts built on first use
    @functools.cached_property
    def items(self) -> Items:
        """What each item is (``data.buckets=auto`` resolved from the model's configs)."""
        multiple = lambda: self.size_multiple(*self.model_configs())[0]
        return Items.of(self.name, self.base.video, self.cfg.data, self.cfg.seed, multiple)

    @functools.cached_property
    def source(self) -> CaptionSource:
        """The ``data.source`` of the run (:func:`~.caption_sources.caption_source`)."""
        m, log = self.cfg.model, self.cfg.log
        teacher = TeacherSampling(self.teacher_pipeline, self.teacher_sample, m.pretrained, log.sample_steps,
                                  log.guidance_scale, self.cfg.seed)
        return caption_source(self.cfg.data, self.items, teacher)

    @functools.cached_property
    def features(self) -> CaptionFeatures:
        """Sizes, the feature cache, batches, flips and caption dropout (:mod:`.caption_data`)."""
        return CaptionFeatures(self.cfg.data, self.items, self.cfg.model)

    @functools.cached_property
    def objective(self) -> Objective:
        """The record's objective built from its run-config section (after :meth:`setup`: it reads the
        pipeline's scheduler)."""
        cls = self.base.objective.load()
        return cls.build(objective_settings(cls, self.cfg), self.model_facts())

    def model_facts(self) -> ModelFacts:
        """What the objective is told: the pipeline's scheduler and expert boundary (after :meth:`setup`),
        the trained expert, the chunks of a block-causal model, the transformer's config (read if asked)."""
        mhla = attention_mhla_config(*self.attention())
        frozen = self.frozen
        return ModelFacts(
            scheduler=frozen.scheduler.config if frozen is not None else {},
            boundary_ratio=frozen.config.get("boundary_ratio") if frozen is not None else None,
            expert=self.cfg.model.expert,
            chunk_frames=mhla.chunk_frames if mhla is not None else None,
            transformer=self.pretrained.transformer,
        )

    def setup(self, accelerator) -> None:
        """The frozen pipeline (:meth:`PretrainedTask.setup`), then the source's own work (teacher
        samples)."""
        super().setup(accelerator)
        self.source.prepare(accelerator.device)

    # --------------------------------------------------------------------------------- checks
    def size_multiple(self, transformer: dict, vae: dict) -> tuple[int, str]:
        """``(multiple, why)``: what heights and widths must be multiples of (VAE, patch, pipeline)."""
        raise NotImplementedError

    def token_grid(self, transformer: dict, vae: dict, height: int, width: int) -> tuple[int, ...]:
        """The transformer's token grid for ``height x width`` pixels (and ``data.num_frames``); ConfigError
        when the frames do not tile."""
        raise NotImplementedError

    def validate(self) -> None:
        """Checkpoint family, sizes vs VAE / patch / pipeline, MHLA blocks vs the token grid, the objective's
        settings, data and cache folders: all before the pipeline is loaded or any item is encoded."""
        self.pretrained.check_family()
        transformer, vae = self.model_configs()
        mhla = attention_mhla_config(*self.attention())
        grid = lambda height, width: self.token_grid(transformer, vae, height, width)
        check_sizes(self.cfg.data, self.items.buckets, self.size_multiple(transformer, vae), grid, mhla,
                    self.base.processor)
        check_mhla_layers(mhla, transformer["num_layers"])
        if mhla is not None:  # e.g. block-causal attention only where the base runs it
            try:
                self.base.processor.check_config(mhla, transformer)
            except ValueError as err:
                raise ConfigError(f"mhla: {err}") from None
        objective = self.base.objective.load()
        objective.check(objective_settings(objective, self.cfg), self.model_facts())
        if self.cfg.train.distill.enabled:  # the log (and config.yaml, run_config) say which teacher
            log_teacher(self.cfg, self.distill_source())
        self.source.validate()
        inputs = {"data.path": self.source.input_path(), "output_dir": self.cfg.output_dir}
        inputs |= {k: v for k, v in self.inputs().items() if k not in inputs and k != "data.cache_dir"}
        check_cache_target(FEATURE_CACHE, self.cache_dir, "data.cache_dir", inputs,  # checkpoints too
                           inside_ok=("output_dir",))

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
        """The cache (and data the source samples) may live in the run folder: the run writes them."""
        return ("data.cache_dir", *self.source.written_inside())

    # ----------------------------------------------------------------------------------- data
    @property
    def cache_dir(self) -> Path:
        return Path(self.cfg.data.cache_dir or Path(self.cfg.output_dir) / "cache")

    def count_items(self) -> int:
        return self.source.count_items()

    def encode_pixels(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """One item's pixels ``(3, H, W)`` / ``(3, F, H, W)`` in [-1, 1] -> ``{"latents": (C, ...), ...}``:
        everything the cache holds that depends on the pixels."""
        raise NotImplementedError

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        """One caption -> ``{"prompt_embeds": (L, D), ...}`` as the pipeline encodes a prompt (the empty
        caption gives what its unconditional branch uses)."""
        raise NotImplementedError

    def build_dataset(self, accelerator) -> Dataset:
        """The feature cache of the source's items, encoded once with the frozen pipeline's encoders."""
        inputs = {"data.path": self.source.input_path(), "output_dir": self.cfg.output_dir}
        encoders = self.encode_pixels, self.encode_text
        return self.features.build(self.source.dataset(), *encoders, self.cache_dir, inputs,
                                   accelerator.device)

    def batch_sampler(self, dataset, batch_size: int, processes: int, seed: int):
        return self.features.batch_sampler(dataset, batch_size, processes, seed)

    # ----------------------------------------------------------------------------------- loss
    def conditioning(self, batch: dict) -> dict:
        """The transformer's caption inputs from a batch of the cache."""
        return {"encoder_hidden_states": batch["prompt_embeds"]}

    def with_condition(self, inputs: dict, batch: dict) -> dict:
        """The transformer's inputs with what the task adds from the batch (image-to-video: the condition)."""
        return inputs

    def model_inputs(self, batch: dict, rnd) -> tuple[dict, tuple]:
        """The transformer's keyword inputs for one micro-batch (the objective's noised latents, the cached
        conditioning, flips and caption dropout applied) and the objective's target."""
        draws = self.objective.draw(rnd, batch["latents"])
        batch = self.features.augmented(batch, rnd)
        inputs, target = self.objective.noised(batch["latents"].float(), draws)
        return self.with_condition({**inputs, **self.conditioning(batch)}, batch), target

    def loss(self, model, batch: dict, rnd) -> torch.Tensor:
        inputs, target = self.model_inputs(batch, rnd)
        prediction = model(**inputs, return_dict=False)[0]
        return self.objective.loss(prediction, target) + self.distillation(prediction, inputs)

    # -------------------------------------------------------------------------------- samples
    def teacher_sample(self, pipe, prompt: str, seed: int):
        """One sample of ``prompt`` from ``pipe`` (``seed``): a PIL image or ``(F, H, W, 3)`` uint8 frames."""
        raise NotImplementedError
