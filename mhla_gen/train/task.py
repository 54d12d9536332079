"""What a model family supplies to the training loop (:class:`TrainTask`), how to watch a run
(:class:`TrainCallback`) and what the loop's stages share (:class:`Run`); the loop is
:mod:`mhla_gen.train.loop`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from ..integration.lora import (
    LORA_TARGET_MODULES,
    add_lora,
    check_lora_targets,
    lora_training_parameters,
    merged_lora_copy,
)
from ..processors.base import MHLAProcessor
from .config import ConfigError, RunConfig
from .distill import Distiller
from .distributed import GatheredEMA
from .randomness import StepRandom


class TrainTask:
    """What one model family plugs into :func:`train` (DiT, SANA, Wan tasks). The methods are listed in
    the order a run calls them: checks before any work, then model, frozen parts, data, the loss of every
    micro-step, the sample grids, and the end of the run."""

    name = "task"
    collate_fn = None
    # FSDP2 (TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap): the classes wrapped as
    # units (empty: the model's _no_split_modules), and those always wrapped (called outside their block)
    fsdp_units: tuple[str, ...] = ()
    fsdp_shared: tuple[str, ...] = ()

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.distiller: Distiller | None = None  # build() attaches one when train.distill is on

    def validate(self) -> None:
        """Check every setting the run uses, also those needed only at the end (sampling, evaluation),
        before any work; raise :class:`ConfigError` naming the setting. Cheap: reads configs, lists files.
        It does not change the config (:meth:`run_config` says what the run resolved)."""

    def run_config(self) -> RunConfig:
        """The config as this run resolved it (e.g. the MHLA a start point was saved with): what
        ``config.yaml`` records. The config itself by default."""
        return self.cfg

    def inputs(self) -> dict[str, str | None]:
        """Every input the run reads, setting -> local path or hub id (start points, teachers, data, VAE):
        ``output_dir`` must be apart from each (:func:`~mhla_gen.outputs.folders.check_apart`), and the run's
        marker records each resolved, with a fingerprint for models."""
        return {}

    def written_inside(self) -> tuple[str, ...]:
        """Input settings that may lie inside ``output_dir`` (things the run itself writes there)."""
        return ()

    def check_data(self) -> None:
        """The start-up checks that read the data itself (e.g. that an item decodes): after the output
        folder was found usable (reading data is work a refused output must not cost), before anything
        is written. Nothing by default."""

    def count_items(self) -> int | None:
        """How many training items the data holds, from a listing (before any cache is built); None
        when unknown until the dataset is built."""
        return None

    def signature(self) -> dict:
        """Settings that decide the parameter shapes; a checkpoint made with others is refused."""
        raise NotImplementedError

    def lora_signature(self) -> dict | None:
        """The signature's ``lora`` entry: rank and alpha (and target modules other than the default) of a
        ``train.trainable=lora`` run, else None (not absent, so checkpoints written before LoRA existed
        still match)."""
        tc = self.cfg.train
        if tc.trainable != "lora":
            return None
        targets = list(tc.lora_target_modules)
        extra = {} if targets == list(LORA_TARGET_MODULES) else {"target_modules": targets}
        return {"rank": tc.lora_rank, "alpha": tc.lora_alpha, **extra}

    def architecture(self) -> nn.Module | None:
        """The transformer to train, built without weights (``accelerate.init_empty_weights``) for checks
        before any work (``train.lora_target_modules``); None when the task cannot say."""
        return None

    def check_lora_targets(self) -> None:
        """``train.trainable=lora``: every ``train.lora_target_modules`` entry names modules of the
        model (:meth:`architecture`); ConfigError naming the first that does not."""
        tc = self.cfg.train
        model = self.architecture() if tc.trainable == "lora" else None
        if model is not None:
            try:
                check_lora_targets(model, tc.lora_target_modules, "train.lora_target_modules")
            except ValueError as err:
                raise ConfigError(str(err)) from None

    def build_transformer(self) -> nn.Module:
        """The transformer to train, MHLA installed (float32 master weights)."""
        raise NotImplementedError

    def setup(self, accelerator) -> None:
        """Load what the task needs besides the transformer (a frozen VAE, text encoders) onto
        ``accelerator.device``. :func:`train` calls it once per run, after :meth:`build_transformer` and
        before :meth:`build_dataset`, in every process (the main process first: downloads are cached
        once). Nothing by default."""

    def build_dataset(self, accelerator) -> Dataset:
        """Training items (dicts of tensors). Caches are built here (main process first), with what
        :meth:`setup` loaded."""
        raise NotImplementedError

    def batch_sampler(self, dataset: Dataset, batch_size: int, processes: int, seed: int) -> Sampler | None:
        """The loader's batches when they are not plain shuffled ones (e.g. one aspect-ratio bucket per
        batch, :class:`~mhla_gen.data.buckets.BucketBatchSampler`): ``batch_size`` items per process,
        ordered by ``seed`` and ``set_epoch`` only (exact resume). None: shuffled batches."""
        return None

    def loss(self, model: nn.Module, batch: dict, rnd: StepRandom) -> torch.Tensor:
        """Scalar training loss of one micro-batch; every random draw goes through ``rnd``. Tasks add
        :meth:`distillation` of their output."""
        raise NotImplementedError

    def distill_teacher(self) -> nn.Module:
        """The frozen teacher of ``train.distill`` (only asked when a distillation weight is > 0)."""
        raise ConfigError(f"train.distill is not supported by the {self.name} task")

    def distillation(self, output: torch.Tensor, inputs: dict) -> torch.Tensor | float:
        """The ``train.distill`` terms of one micro-batch (0 when off); ``inputs``: the transformer's
        keyword inputs that gave ``output``."""
        return 0.0 if self.distiller is None else self.distiller(output, inputs)

    def trainable_parameters(self, transformer: nn.Module) -> list[nn.Parameter]:
        """What the optimizer trains (the rest is frozen): ``train.trainable`` by default."""
        return trainable_parameters(transformer, self.cfg.train.trainable)

    def sample_images(self, transformer: nn.Module) -> tuple[list, int]:
        """``(PIL images, columns)`` for a sample grid, through the real diffusers pipeline."""
        return [], 1

    def with_lora(self, transformer: nn.Module) -> nn.Module:
        """``train.trainable=lora``: a LoRA adapter on every attention's q/k/v/out.0, the MHLA parameters
        kept trainable (``mhla_gen.integration.lora.add_lora``); ``transformer`` as it is otherwise."""
        tc = self.cfg.train
        if tc.trainable != "lora":
            return transformer
        return add_lora(transformer, tc.lora_rank, tc.lora_alpha, tc.lora_target_modules,
                        lora_dropout=tc.lora_dropout)

    def save_final(self, transformer: nn.Module, folder: Path) -> None:
        """Write the final weights into ``folder`` (main process): ``save_pretrained``, a LoRA run's adapter
        merged into the weights first (a plain model folder; a task whose pipelines load LoRA folders
        overrides this)."""
        if self.cfg.train.trainable == "lora":
            transformer = merged_lora_copy(transformer)
        transformer.save_pretrained(str(folder))

    def model_record(self) -> dict:
        """Facts recorded in ``final/``'s marker that later commands check against (e.g. DiT's classes)."""
        return {}

    def finish(self, transformer: nn.Module, accelerator) -> dict:
        """End-of-run evaluation (main process, final weights); returns metrics to record."""
        return {}


def trainable_parameters(transformer: nn.Module, which: str) -> list[nn.Parameter]:
    """``all``: every parameter; ``mhla``: only those of the MHLA processors; ``lora``: the LoRA adapter
    and the MHLA parameters (``mhla_gen.integration.lora``). The others are frozen."""
    if which == "all":
        params = list(transformer.parameters())
    elif which == "lora":
        params = lora_training_parameters(transformer)
    else:
        params = [p for m in transformer.modules() if isinstance(m, MHLAProcessor) for p in m.parameters()]
        if not params:
            raise ValueError(
                "train.trainable=mhla but the transformer has no MHLA processors (model.attention=softmax?)"
            )
    keep = {id(p) for p in params}
    for p in transformer.parameters():
        p.requires_grad_(id(p) in keep)
    return params


def empty_model(cls: type, config: dict) -> nn.Module:
    """A diffusers model of class ``cls`` from a ``config.json`` dict, its weights on the meta device
    (``accelerate.init_empty_weights``): the module tree for checks, no memory, no weights read."""
    from accelerate import init_empty_weights

    init, _, _ = cls.extract_init_dict(dict(config))
    with init_empty_weights():
        return cls(**init)


class TrainCallback:
    """Points of a run where :func:`train` calls out; each method does nothing here. Subclass it to watch
    or interrupt a run, and pass instances as ``train(cfg, task, callbacks=[...])`` (the tests' fault
    injection, ``tests/fault_injection.py``, SIGKILLs the process from these points)."""

    def on_step_end(self, run: Run) -> None:
        """Every process, after optimizer step ``run.step`` and its metrics record and checkpoint (when
        due), before its sample grid (when due)."""

    def on_checkpoint_staged(self, run: Run) -> None:
        """Main process: the checkpoint of ``run.step`` is complete and listed in its marked temporary folder
        (``checkpoints/.tmp-checkpoint_<step>``) and not yet renamed into place (a kill here leaves a torn
        save that resume must ignore and the next start deletes). Write nothing into that folder."""


@dataclass
class Run:
    """What the stages of one :func:`train` call share. :func:`start_run` fills the settings part,
    :func:`build` the model part; ``step`` counts the optimizer steps done so far."""

    cfg: RunConfig
    task: TrainTask
    accelerator: Accelerator
    out: Path  # output_dir
    local_batch: int  # items per process per micro-step
    fsdp: bool  # sharded parameters: sharded EMA, no sample grids while training, final weights gathered
    resume_from: Path | None  # the checkpoint this run continues from
    step: int
    callbacks: Sequence[TrainCallback] = ()
    transformer: nn.Module | None = None  # prepared by Accelerate (maybe wrapped)
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: object = None
    loader: DataLoader | None = None
    batch_sampler: Sampler | None = None  # the task's own (before prepare), when it has one
    params: list[nn.Parameter] = field(default_factory=list)  # the trainable ones, after prepare
    ema: GatheredEMA | None = None
