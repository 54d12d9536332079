"""The record of a base model family: everything mhla_gen needs to know about DiT, SANA, Wan, ...

One :class:`Base` per family, one module per record (``bases/dit.py``, ...), listed once in
``bases/__init__.py``. Every "which base" question (install, save/load, sampling, evaluation, training,
conversion) asks a record; nothing else compares base names. ``docs/extending.md`` walks through the fields.

The record holds the MHLA processor class itself (processors sit below every other layer of the package)
and names the upper layers (run config, training task and objective, pipeline sampler, test reference) as
``module:attribute`` references (:class:`Ref`), imported on first use: importing a record loads no training,
pipeline or test code, so ``mhla-gen adopt`` stays light and no import cycle runs through the
records.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..processors.base import MHLAProcessor

CONDITIONING = ("labels", "captions", "captions+image")
CAPABILITIES = ("lora", "group_offloading", "single_file", "context_parallel")
"""What diffusers may offer a transformer class (:attr:`Base.capabilities`)."""


@dataclass(frozen=True)
class Ref:
    """``"package.module:attribute"``, imported by :meth:`load` (like a ``pyproject`` entry point)."""

    path: str

    def load(self) -> Any:
        module, _, attribute = self.path.partition(":")
        return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class TokenGrid:
    """How a latent maps to the token grid MHLA tiles (the processor computes it: ``latent_grid``).

    Attributes:
        ndim: 2 (images: ``(H / p, W / p)``) or 3 (video: ``(F / pt, H / ph, W / pw)``); the rank of
            ``MHLAConfig.blocks``.
        patch: the transformer config key holding the patch size (an int, or ``(pt, ph, pw)``).
        rope: where rotary position enters the self-attention (``none``, or the processor's options).
    """

    ndim: int
    patch: str = "patch_size"
    rope: str = "none"


@dataclass(frozen=True)
class Base:
    """What mhla_gen knows about one base model family.

    Attributes:
        name: the key users write (``--base NAME``, ``base=NAME``); also recorded in MHLA files.
        processor: the :class:`MHLAProcessor` subclass for its self-attention; its ``model_cls`` is the
            diffusers transformer class.
        pipeline_class: the stock diffusers pipeline that samples it (a ``diffusers`` attribute name).
        grid: the token grid (:class:`TokenGrid`).
        conditioning: ``labels`` (class ids), ``captions`` (text prompts) or ``captions+image``.
        objective: the training objective its task builds and trains with (:class:`Ref` to a
            :class:`~mhla_gen.train.objectives.Objective` class: ``mhla_gen.train.objectives:DDPM``, DiT's
            DDPM with or without a learned variance; ``...:FlowMatching``, rectified flow matching); its
            run config has that objective's settings section (``diffusion``, ``flow``).
        data_sources: the ``data.source`` values its training task reads (its run config accepts these).
        sampler: its :class:`~mhla_gen.pipelines.PipelineSampler` (loader + sampling call; :class:`Ref`).
        stream_sampler: the sampler of its block-causal models (``mhla-gen sample --stream``,
            ``docs/streaming.md``; :class:`Ref`), or None: it does not stream.
        tiny: its test reference (:class:`Ref` to a :class:`mhla_gen.testing.TinyBase`): a tiny transformer
            and pipeline, forward inputs, a test MHLA config, a tiny sampling call and the tiny training
            config. The cross-cutting tests (loaders, LoRA, compile, offloading, save / load, FSDP,
            conversion, attention statistics) run on every record through it, and
            ``mhla_gen.metrics.attention.example_inputs`` builds a model's forward inputs with it.
        run_config: the run-config dataclass of its training script (:class:`Ref`; None: no training
            task yet, the base samples, installs, saves and loads only).
        task: the :class:`~mhla_gen.train.task.TrainTask` that trains it (:class:`Ref`, or None).
        converter_config: the shipped stage-1 config (``mhla-gen linearize --base NAME --config X``) for
            its real size, by name (``mhla_gen.configs``: ``linearize/wan_1_3b_480p``; None without a
            training task).
        text_dim: the transformer config key of the caption-embedding width (None without captions).
        diffusers_tests: diffusers' own test suite of the transformer (a path in a diffusers checkout,
            or one ``scripts/diffusers_model_tests.py`` writes there, which runs it; None: none).
        diffusers_pipeline_tests: diffusers' own test suites of the stock pipelines that sample it (paths
            in a diffusers checkout; ``scripts/diffusers_model_tests.py --pipelines`` runs them).
        release_checkpoint: reads a single-file checkpoint of an original MHLA release for
            ``from_single_file`` of the MHLA class (:class:`Ref` to ``f(checkpoint, load_config) -> model |
            None``: None when the checkpoint is not in the release format;
            :mod:`mhla_gen.integration.single_file`). None: no release to read (an MHLA single file is then
            refused).
    """

    name: str
    processor: type[MHLAProcessor]
    pipeline_class: str
    grid: TokenGrid
    conditioning: str
    objective: Ref
    data_sources: tuple[str, ...]
    sampler: Ref
    tiny: Ref
    run_config: Ref | None = None
    task: Ref | None = None
    converter_config: str | None = None
    text_dim: str | None = None
    diffusers_tests: str | None = None
    diffusers_pipeline_tests: tuple[str, ...] = ()
    release_checkpoint: Ref | None = None
    stream_sampler: Ref | None = None

    def __post_init__(self):
        if self.conditioning not in CONDITIONING:
            raise ValueError(f"Base {self.name}: conditioning must be one of {CONDITIONING}")
        if not isinstance(self.objective, Ref):
            raise ValueError(f"Base {self.name}: objective must be a Ref to an objective class "
                             f"(module:attribute), got {self.objective!r}")
        if self.grid.ndim != self.processor.grid_ndim:
            raise ValueError(f"Base {self.name}: grid.ndim={self.grid.ndim} but its processor's is "
                             f"{self.processor.grid_ndim}")

    @property
    def transformer_class(self) -> type:
        """The diffusers transformer class (the processor's ``model_cls``)."""
        return self.processor.model_cls

    @property
    def class_name(self) -> str:
        """The diffusers transformer class's name (what a ``config.json`` records as ``_class_name``)."""
        return self.transformer_class.__name__

    @property
    def video(self) -> bool:
        """Whether samples are videos (3D token grid): MP4 files, frame counts."""
        return self.grid.ndim == 3

    @property
    def context_parallel(self) -> bool:
        """Whether the transformer class has a diffusers context-parallel plan (``_cp_plan``), so that
        ``enable_parallelism`` shards its tokens and MHLA all-reduces its summaries
        (``mhla_gen.ops.context_parallel``). diffusers 0.42: DiT, SANA and SANA-Video have none; Wan (T2V,
        I2V, both Wan2.2 experts) has one."""
        return getattr(self.transformer_class, "_cp_plan", None) is not None

    @property
    def capabilities(self) -> frozenset[str]:
        """What diffusers offers the transformer class, read from the class (:data:`CAPABILITIES`):
        ``lora`` (diffusers' ``PeftAdapterMixin``: ``add_adapter``, ``load_lora_adapter``, the pipeline's
        ``load_lora_weights``), ``group_offloading`` (``_supports_group_offloading``), ``single_file``
        (``from_single_file``), ``context_parallel`` (:attr:`context_parallel`). diffusers 0.42: DiT has none
        of them; SANA and SANA-Video all but context parallelism; Wan and Wan I2V all. The cross-cutting tests
        run each capability a base has and check the refusal of each it lacks."""
        cls = self.transformer_class
        offered = {
            "lora": hasattr(cls, "load_lora_adapter"),
            "group_offloading": bool(getattr(cls, "_supports_group_offloading", False)),
            "single_file": hasattr(cls, "from_single_file"),
            "context_parallel": self.context_parallel,
        }
        return frozenset(name for name, has in offered.items() if has)

    @property
    def class_conditional(self) -> bool:
        return self.conditioning == "labels"

    @property
    def image_conditioned(self) -> bool:
        """Whether each sample needs an image next to its prompt (``captions+image``: image-to-video)."""
        return self.conditioning == "captions+image"

    @property
    def sample_suffix(self) -> str:
        """The file suffix of one sample: ``.mp4`` (video) or ``.png``."""
        return ".mp4" if self.video else ".png"

    @property
    def trains(self) -> bool:
        """Whether a training task (and so fine-tuning and stage-1 conversion) exists for this base."""
        return self.task is not None and self.run_config is not None

    def matches(self, config: dict) -> bool:
        """Whether a transformer ``config.json`` of :attr:`transformer_class` is this base (records that
        share a transformer class, e.g. Wan variants, tell theirs apart here; the first match wins)."""
        return True
