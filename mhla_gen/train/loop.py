"""The one Accelerate training loop shared by DiT, SANA and Wan; a :class:`TrainTask` supplies the rest.

:func:`train` runs four stages, top to bottom, sharing one :class:`Run`:

    start_run  Accelerator, every check (task.validate, batch sizes, start plan), then output_dir claimed
               and config.yaml written: nothing is written before the checks pass
    build      task.build_transformer -> AdamW (+ EMA) -> task.setup -> task.build_dataset -> prepare
               -> resume (atomic checkpoint, seeded sampler + skip_first_batches, step count)
    run_steps  task.loss -> backward -> clip -> step -> clamp_mixing_ -> EMA -> log / checkpoint /
               callbacks / sample grid, whichever is due
    finish     output_dir/final (EMA weights where used, a model card) -> last sample grid -> task.finish
               (e.g. FID) -> the card again with its metrics -> share.push_to_hub (when set)

Exact resume: the data order comes from Accelerate's seedable sampler (epoch-seeded) plus
``skip_first_batches``; the per-step noise comes from :class:`StepRandom` seeded by the micro-step;
model, optimizer, LR scheduler, EMA (``register_for_checkpointing``) and RNG states come from
``accelerator.load_state``. A run killed with SIGKILL and resumed ends with the same weights.

Where a run starts (:func:`plan_start`): ``resume=latest`` continues from the newest checkpoint in
``output_dir``. Without one it starts at step 0, and the records of an interrupted earlier run (which
this run is about to redo) are dropped from ``metrics.jsonl``; a folder holding a *finished* run
(``final/``) is refused instead. In every case ``metrics.jsonl`` keeps only the rows up to the start step,
and TensorBoard hides the events past it (``SummaryWriter(purge_step=start + 1)``). The output folder is
a folder this project marked as a run (:mod:`mhla_gen.outputs`): any other non-empty folder is refused,
and ``final/`` is written in a temporary sibling and put in place when complete.

FSDP is decided once (:attr:`Run.fsdp`, :mod:`mhla_gen.train.distributed`): the task names its FSDP2
units, the EMA follows the shards (:class:`GatheredEMA`), sample grids are skipped while training, and
:func:`finish` gathers the full (EMA) weights into a fresh ``task.build_transformer()``. DeepSpeed and
launches that would silently run one process are refused at start-up. What people see of a run (summary,
trackers, schedule) is in :mod:`mhla_gen.train.tracking`.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, skip_first_batches
from accelerate.utils import ProjectConfiguration, set_seed
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..integration.cards import check_push_target, push_to_hub, scrub_local_paths
from ..integration.lora import (
    LORA_TARGET_MODULES,
    add_lora,
    check_lora_targets,
    lora_training_parameters,
    merged_lora_copy,
)
from ..ops.mixing import clamp_mixing_
from ..outputs.folders import (
    check_apart,
    check_replaceable,
    check_temp,
    claim,
    fresh_temp,
    input_record,
    owned,
    replace_with,
    write_marker,
)
from ..outputs.locks import die_with_launcher, release
from ..processors.base import MHLAProcessor
from . import checkpoint as ckpt
from .card import write_run_card
from .config import (
    CHANGED_DEFAULTS,
    ConfigError,
    RunConfig,
    TrainConfig,
    config_to_dict,
    config_to_yaml,
    given_settings,
)
from .distill import Distiller
from .distributed import GatheredEMA, check_fsdp, check_launcher, check_world_size, is_sharded, set_fsdp_units
from .io import append_jsonl, atomic_write_text, read_jsonl
from .optimizers import check_optimizer, make_optimizer
from .randomness import StepRandom
from .tracking import check_trackers, log_grid, make_lr_scheduler, run_summary, tracker_init_kwargs

logger = logging.getLogger(__name__)

RUN_FOLDER = "run"  # the kind of folder an output_dir is (mhla_gen.outputs.folders.KINDS)


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


def train(cfg: RunConfig, task: TrainTask, callbacks: Sequence[TrainCallback] = ()) -> Path:
    """Run ``task`` with ``cfg`` (stages in the module docstring); returns ``output_dir/final``."""
    run = start_run(cfg, task, callbacks)
    try:
        build(run)
        run_steps(run)
        return finish(run)
    finally:
        release(run.out)  # the output folder's lock (outputs.locks); an exit of any kind also ends it


# ---------------------------------------------------------- 1. start_run: settings, checks, output folder
def start_run(cfg: RunConfig, task: TrainTask, callbacks: Sequence[TrainCallback] = ()) -> Run:
    """The Accelerator, every check (raising before anything is written), where the run starts, then
    ``output_dir`` claimed with its ``config.yaml`` (main process) and the global seed set."""
    out = Path(cfg.output_dir).expanduser()
    check_launcher()  # DeepSpeed: refused before Accelerate starts it
    die_with_launcher()  # a rank of torchrun / accelerate launch stops with it (SIGKILL included)
    check_trackers(cfg.log.trackers)  # Accelerate would only warn about a missing package
    check_optimizer(cfg.train)  # its package imports
    check_push_target(cfg.share.push_to_hub, "share.push_to_hub")  # a repo id and a token to push with
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
        mixed_precision=cfg.train.mixed_precision,
        log_with=list(cfg.log.trackers) or None,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
    )
    check_world_size(accelerator)
    check_fsdp(accelerator)  # an FSDP launch that Accelerate runs unsharded (e.g. on CPU)
    local_batch = local_batch_size(cfg.train, accelerator.num_processes)
    task.validate()  # everything the run uses, before any work
    task.check_lora_targets()
    inputs = task.inputs()
    check_apart(out, "output_dir", inputs, holds_ok=task.written_inside())  # never where an input is
    check_batch_fits(task.count_items(), local_batch * accelerator.num_processes, cfg.train.global_batch_size)
    resume_from, step = plan_start(cfg, out)
    if resume_from is not None:
        ckpt.check_signature(resume_from, task.signature())
        follow_recorded(cfg, resume_from)
    check_run_folder(out)  # every process: all raise, none waits
    task.check_data()
    fsdp = is_sharded(accelerator)

    if cfg.train.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    set_seed(cfg.seed)  # same on every process: identical initial weights
    if accelerator.is_main_process:
        prepare_output_dir(out, step, recorded_inputs(inputs))
        config = with_resolved_inputs(task.run_config(), inputs)
        atomic_write_text(out / "config.yaml", config_to_yaml(config))  # before step 0
        ckpt.remove_partial(out)
    accelerator.wait_for_everyone()
    return Run(
        cfg=cfg, task=task, accelerator=accelerator, out=out, local_batch=local_batch, fsdp=fsdp,
        resume_from=resume_from, step=step, callbacks=tuple(callbacks),
    )


def local_batch_size(tc: TrainConfig, num_processes: int) -> int:
    """Items per process per micro-step: ``global_batch_size / (processes x accumulation steps)``;
    :class:`ConfigError` when that does not divide."""
    per_step = num_processes * tc.gradient_accumulation_steps
    if tc.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={tc.global_batch_size} is not divisible by processes x "
            f"accumulation steps = {per_step}"
        )
    return tc.global_batch_size // per_step


def plan_start(cfg: RunConfig, out: Path) -> tuple[Path | None, int]:
    """``(checkpoint to resume from or None, step this run starts at)``; see the module docstring.

    Raises:
        ConfigError: ``resume=latest`` without a checkpoint in a folder that holds a finished run, or
            checkpoints in ``output_dir`` newer than the start step (a later ``resume=latest`` would
            continue from them instead of from this run).
    """
    resume_from = ckpt.resolve_resume(cfg.resume, out)
    start = ckpt.read_state(resume_from)["step"] if resume_from is not None else 0
    if resume_from is None and cfg.resume == "latest" and (out / "final").exists():
        raise ConfigError(
            f"resume=latest: output_dir={str(out)!r} holds a finished run (final/) but no checkpoint to "
            f"continue from; nothing was changed: choose another output_dir for the new run"
        )
    newer = [p.name for p in ckpt.list_checkpoints(out) if ckpt.checkpoint_step(p) > start]
    if newer:
        raise ConfigError(
            f"resume={cfg.resume}: this run starts at step {start}, but output_dir={str(out)!r} holds "
            f"later checkpoints {newer} that a later resume=latest would continue from; move them away "
            f"or choose another output_dir"
        )
    return resume_from, start


def follow_recorded(cfg: RunConfig, resume_from: Path) -> None:
    """A resumed run keeps the value its ``config.yaml`` records for a setting whose default changed since
    (:data:`~mhla_gen.train.config.CHANGED_DEFAULTS`, e.g. ``train.max_grad_norm``), unless the setting
    is given again (config file or command line); a warning says which value it goes on with. ``cfg`` is
    changed in place (before ``config.yaml`` is written again)."""
    from omegaconf import OmegaConf

    record = Path(resume_from).parent.parent / "config.yaml"  # output_dir/checkpoints/checkpoint_N
    if not record.is_file():
        return
    recorded, given = OmegaConf.load(record), given_settings(cfg)
    for setting, (old_default, date) in CHANGED_DEFAULTS.items():
        *parents, name = setting.split(".")
        section = cfg
        for part in parents:
            section = getattr(section, part)
        value, now = OmegaConf.select(recorded, setting), getattr(section, name)
        if value is None or value == now:
            continue
        if given is None or setting in given:
            logger.warning("resume: %s=%s as given; this run's config.yaml recorded %s", setting, now, value)
            continue
        setattr(section, name, value)
        logger.warning("resume: %s=%s, as this run's config.yaml records (the default is %s since %s; it was "
                       "%s); give %s=... to change it", setting, value, now, date, old_default, setting)


def check_batch_fits(items: int | None, per_micro_step: int, global_batch: int) -> None:
    """``ConfigError`` when the data cannot fill one optimizer step (``per_micro_step`` items over all
    processes; the loader drops incomplete batches)."""
    if items is not None and items < per_micro_step:
        raise ConfigError(
            f"dataset has {items} items, fewer than one global batch ({global_batch}); lower "
            f"train.global_batch_size"
        )


def check_run_folder(out: Path) -> None:
    """``output_dir`` must be new, empty or a run folder of ours, and its ``final/`` (replaced at the end)
    must hold nothing but a saved model; ``ConfigError`` otherwise, before any work."""
    if owned(out, RUN_FOLDER, "output_dir"):  # final/ unmarked or a symlink: foreign, refused
        check_replaceable(out / "final", "model", "output_dir (its final/)")
        check_temp(out / "final", "model", "output_dir (its final/)")


DATA_SETTINGS = ("data.path", "data.cache_dir", "data.prompts_file")  # recorded by path, not fingerprinted


def recorded_inputs(inputs: dict[str, str | None]) -> dict:
    """``{setting: input_record}`` of the task's inputs (:meth:`TrainTask.inputs`): resolved absolute paths,
    models fingerprinted."""
    return {
        setting: ({"path": str(Path(path).expanduser().resolve())} if setting in DATA_SETTINGS
                  else input_record(path))
        for setting, path in inputs.items() if path
    }


def with_resolved_inputs(config: RunConfig, inputs: dict[str, str | None]) -> RunConfig:
    """A copy of ``config`` whose input settings (``{"model.init_from": path, ...}``, as
    :meth:`TrainTask.inputs` reports them) name local paths resolved and absolute, so ``config.yaml``
    says which teacher, start point and data a run used wherever it is read from (hub ids stay)."""
    config = copy.deepcopy(config)
    for setting, value in inputs.items():
        *parents, name = setting.split(".")
        target = config
        for part in parents:
            target = getattr(target, part, None)
        if value and hasattr(target, name) and Path(value).expanduser().exists():
            setattr(target, name, str(Path(value).expanduser().resolve()))
    return config


def prepare_output_dir(out: Path, start: int, inputs: dict | None = None) -> None:
    """Main process: claim (and lock) ``out`` as a run folder recording the run's ``inputs``, and keep
    only the ``metrics.jsonl`` rows up to ``start`` (the rows after it are written again by this run)."""
    claim(out, RUN_FOLDER, "output_dir", **({"inputs": inputs} if inputs else {}))
    if inputs:
        logger.info("inputs: %s", "; ".join(f"{k}={v.get('path', v.get('hub'))}" for k, v in inputs.items()))
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        records = read_jsonl(metrics)
        kept = [r for r in records if r.get("step", 0) <= start]
        if len(kept) < len(records):
            logger.warning(
                "%s: dropping %d records past step %d (this run writes those steps again)",
                metrics,
                len(records) - len(kept),
                start,
            )
        atomic_write_text(metrics, "".join(f"{json.dumps(r)}\n" for r in kept))


# ----------------------------------------------------------------------- 2. build: model, optimizer, data
def processes_mean(accelerator):
    """The mean of a tensor over data-parallel processes (every process must call it), or None with one
    process: what makes a ratio of batch means the whole batch's rather than each shard's."""
    if accelerator.num_processes == 1:
        return None
    return lambda tensor: accelerator.reduce(tensor, reduction="mean")


def build(run: Run) -> None:
    """Transformer (trainable parameters chosen), optimizer and LR schedule, the task's frozen parts and
    data, all prepared by Accelerate; the EMA of the prepared (maybe sharded) parameters; then the
    checkpoint's state when resuming, the run summary and the trackers."""
    cfg, tc, accelerator, task = run.cfg, run.cfg.train, run.accelerator, run.task
    transformer = task.build_transformer()
    if tc.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.train()
    params = task.trainable_parameters(transformer)
    optimizer = make_optimizer(tc, params, sharded=run.fsdp)
    lr_scheduler = make_lr_scheduler(tc, optimizer, accelerator.num_processes)
    with accelerator.main_process_first():
        task.setup(accelerator)
        if tc.distill.enabled:
            teacher = task.distill_teacher().to(accelerator.device)
            weights = tc.distill.output_weight, tc.distill.attention_weight
            task.distiller = Distiller(teacher, transformer, *weights, power_mean=processes_mean(accelerator))
        dataset = task.build_dataset(accelerator)
    loader = _loader(run, dataset)
    check_batch_fits(len(dataset), run.local_batch, tc.global_batch_size)  # the loader drops partial batches
    if run.batch_sampler is not None and len(loader) == 0:  # each bucket holds less than a global batch
        raise ConfigError(f"no bucket of the data holds a whole micro-batch ({run.local_batch} x "
                          f"{accelerator.num_processes} processes); lower train.global_batch_size or merge "
                          f"buckets (data.buckets)")
    summary = run_summary(cfg, task.name, transformer, len(dataset), accelerator, run.local_batch, run.step,
                          _distributed(run))  # before prepare: shards would count 1/N
    if run.fsdp:
        units = set_fsdp_units(accelerator, list(task.fsdp_units), list(task.fsdp_shared))
        summary += "\n  fsdp units     " + (", ".join(units) if units else "the model's _no_split_modules")
    run.transformer, run.optimizer, run.loader, run.lr_scheduler = accelerator.prepare(
        transformer, optimizer, loader, lr_scheduler
    )
    run.params = [p for p in run.transformer.parameters() if p.requires_grad]  # prepared (maybe sharded)
    if tc.ema_decay > 0:  # of the prepared parameters: under FSDP each rank averages its own shards
        run.ema = GatheredEMA(run.params, decay=tc.ema_decay)
        accelerator.register_for_checkpointing(run.ema)

    if run.resume_from is not None:
        accelerator.load_state(str(run.resume_from))
        logger.info("resumed from %s at step %d", run.resume_from, run.step)
    if accelerator.is_main_process:
        logger.info("%s", summary)
    if accelerator.is_main_process and cfg.log.trackers:
        accelerator.init_trackers(
            task.name, config=_flat(config_to_dict(cfg)), init_kwargs=tracker_init_kwargs(run.out, run.step)
        )


def _distributed(run: Run) -> str:
    """How the run is spread, e.g. ``8 processes (FSDP), cuda:0`` or ``1 process, cpu``."""
    accelerator = run.accelerator
    kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
    n = accelerator.num_processes
    return f"{n} process{'es' if n > 1 else ''}" + (f" ({kind})" if n > 1 else "") + f", {accelerator.device}"


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


def _loader(run: Run, dataset: Dataset) -> DataLoader:
    """Shuffled (seeded), incomplete last batch dropped; Accelerate's ``prepare`` makes its sampler
    seedable per epoch and shards it over processes. A task's own batch sampler (buckets) replaces the
    shuffling; :func:`_batches` sets its epoch."""
    common = dict(
        num_workers=_num_workers(run.cfg.train.num_workers),
        collate_fn=run.task.collate_fn,
        pin_memory=run.accelerator.device.type == "cuda",  # with non_blocking: batches copied asynchronously
    )
    processes = run.accelerator.num_processes
    run.batch_sampler = run.task.batch_sampler(dataset, run.local_batch, processes, run.cfg.seed)
    if run.batch_sampler is not None:
        return DataLoader(dataset, batch_sampler=run.batch_sampler, **common)
    generator = torch.Generator().manual_seed(run.cfg.seed)
    return DataLoader(dataset, batch_size=run.local_batch, shuffle=True, drop_last=True, generator=generator,
                      **common)


def _num_workers(requested: int) -> int:
    """``train.num_workers``; -1 = min(4, CPUs this process may use)."""
    if requested >= 0:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(4, cpus)


# ---------------------------------------------------------------------------- 3. run_steps: the step loop
def run_steps(run: Run) -> None:
    """Optimizer steps from ``run.step`` to ``train.max_steps``. The data continue where the step count
    puts them (epoch-seeded order, the epoch's used batches skipped); each micro-step draws its noise from
    :class:`StepRandom` seeded by its index, so an interrupted and resumed run sees the same numbers."""
    cfg, accelerator = run.cfg, run.accelerator
    micro = run.step * cfg.train.gradient_accumulation_steps
    epoch, skip = divmod(micro, len(run.loader))
    generator = torch.Generator(accelerator.device)  # re-seeded by every micro-step's StepRandom
    meter = _Meter(run.step)
    bar = tqdm(
        total=cfg.train.max_steps, initial=run.step, disable=not accelerator.is_local_main_process,
        desc=run.task.name,
    )
    with logging_redirect_tqdm():  # log lines (checkpoint saves, warnings) print above the bar
        while run.step < cfg.train.max_steps:
            for batch in _batches(run.loader, epoch, skip, run.batch_sampler):
                rnd = StepRandom(
                    cfg.seed, micro, run.local_batch, accelerator.process_index, accelerator.num_processes,
                    accelerator.device, generator,
                )
                _micro_step(run, batch, rnd, meter)
                micro += 1
                if accelerator.sync_gradients:  # this micro-step ended an optimizer step
                    _after_step(run, meter, bar)
                    if run.step >= cfg.train.max_steps:
                        break
            epoch, skip = epoch + 1, 0
        bar.close()


def _batches(loader, epoch: int, skip: int, batch_sampler: Sampler | None = None) -> Iterator:
    """Batches of ``epoch`` from batch ``skip`` on (resume mid-epoch), in the same order as uninterrupted.
    ``batch_sampler``: the task's own, whose epoch is set here (Accelerate's wrappers for several processes
    and for skipping do not pass ``set_epoch`` on to it)."""
    loader.set_epoch(epoch)  # SeedableRandomSampler: permutation seeded by seed + epoch
    if batch_sampler is not None:
        batch_sampler.set_epoch(epoch)
    return iter(skip_first_batches(loader, skip) if skip else loader)


def _micro_step(run: Run, batch: dict, rnd: StepRandom, meter: _Meter) -> None:
    """Loss and backward of one micro-batch; the optimizer steps (after clipping) when Accelerate says
    the accumulation is complete, otherwise its ``step``/``zero_grad`` are no-ops."""
    accelerator = run.accelerator
    with accelerator.accumulate(run.transformer):
        loss = run.task.loss(run.transformer, batch, rnd)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            meter.grad_norm = accelerator.clip_grad_norm_(run.params, run.cfg.train.max_grad_norm or math.inf)
        run.optimizer.step()
        run.lr_scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
    meter.add(loss)


def _after_step(run: Run, meter: _Meter, bar) -> None:
    """One optimizer step done: count it, clamp the mixing matrices, update the EMA, then the metrics
    record, checkpoint, callbacks and sample grid that are due."""
    cfg = run.cfg
    run.step += 1
    clamp_mixing_(run.transformer)
    if run.ema is not None:
        run.ema.step(run.params)
    bar.update(1)
    last = run.step == cfg.train.max_steps
    if run.step % cfg.log.every == 0 or last:
        record = meter.record(run)
        bar.set_postfix(loss=f"{record['loss']:.4f}")
        run.accelerator.log(record, step=run.step)
        if run.accelerator.is_main_process:
            append_jsonl(run.out / "metrics.jsonl", record)
    if run.step % cfg.train.checkpoint_every == 0 or last:
        staged = lambda: [callback.on_checkpoint_staged(run) for callback in run.callbacks]
        limit = cfg.train.checkpoints_total_limit
        ckpt.save_checkpoint(run.accelerator, run.out, run.step, run.task.signature(), limit, staged)
    for callback in run.callbacks:
        callback.on_step_end(run)
    if cfg.log.sample_every and run.step % cfg.log.sample_every == 0 and not last:
        sample(run)


class _Meter:
    """Mean loss over the micro-steps (and processes) since the last record, the last gradient norm, and
    the steps per second since the last record."""

    def __init__(self, step: int):
        self.loss_sum, self.count, self.grad_norm = 0.0, 0, math.nan
        self.time, self.step = time.perf_counter(), step

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum, self.count = self.loss_sum + loss.detach().float(), self.count + 1

    def record(self, run: Run) -> dict:
        """The ``metrics.jsonl`` record of ``run.step`` (a collective: every process); restarts the sums."""
        mean_loss = run.accelerator.reduce(self.loss_sum / self.count, "mean").item()
        now = time.perf_counter()
        record = {
            "step": run.step,
            "loss": mean_loss,
            "lr": run.lr_scheduler.get_last_lr()[0],
            "grad_norm": float(self.grad_norm),
            "steps_per_s": (run.step - self.step) / (now - self.time),
            "num_processes": run.accelerator.num_processes,
        }
        self.loss_sum, self.count, self.time, self.step = 0.0, 0, now, run.step
        return record


def sample(run: Run, final: nn.Module | None = None, at_end: bool = False) -> None:
    """Main process: a sample grid of the current weights (the EMA ones where kept; at the end: ``final``,
    the main process's full model) into ``samples/step_<step>.png`` and the trackers; skipped under FSDP
    while training, where no process holds the whole model."""
    accelerator = run.accelerator
    if run.fsdp and not at_end:
        logger.warning("sample grids are skipped under FSDP (sharded weights); sample from final/")
        return
    if accelerator.is_main_process:
        logger.info("sampling the grid of step %d (%d denoising steps)", run.step, run.cfg.log.sample_steps)
        model = final if at_end else accelerator.unwrap_model(run.transformer)
        with _ema_weights(None if at_end else run.ema, run.params):  # (finish swapped them in itself)
            model.eval()
            images, columns = run.task.sample_images(model)
            model.train(not at_end)
        grid = save_image_grid(images, columns, run.out / "samples" / f"step_{run.step:07d}.png")
        if grid is not None:
            log_grid(accelerator, grid, run.step)
    accelerator.wait_for_everyone()


def save_image_grid(images: list, columns: int, path: Path) -> Image.Image | None:
    """Tile PIL images into one PNG (written through a temp file); returns the grid (None: no images)."""
    if not images:
        return None
    w, h = images[0].size
    rows = math.ceil(len(images) / columns)
    grid = Image.new(images[0].mode, (columns * w, rows * h))
    for i, img in enumerate(images):
        grid.paste(img, ((i % columns) * w, (i // columns) * h))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    grid.save(tmp)
    os.replace(tmp, path)
    return grid


# ----------------------------------------------------------------- 4. finish: final/, samples, evaluation
def finish(run: Run) -> Path:
    """``final/`` (EMA weights where kept), then the last sample grid (a failure there cannot lose the
    trained weights), then ``task.finish``'s metrics; returns ``output_dir/final``. The EMA weights stay
    swapped in (every process) until the end: under FSDP gathering them is a collective."""
    accelerator, final = run.accelerator, run.out / "final"
    accelerator.wait_for_everyone()
    with _ema_weights(run.ema, run.params):
        model = _full_model(run)  # None outside the main process
        if accelerator.is_main_process:
            model.eval()
            save_final_folder(run.task, model, final)
        accelerator.wait_for_everyone()
        sample(run, model, at_end=True)
        if accelerator.is_main_process:
            logger.info("end-of-run evaluation (%s)", run.task.name)
            _record_final_metrics(run, run.task.finish(model.eval(), accelerator))
            _write_card(run.task, model, final)  # again, with the end-of-run metrics
            _push(final, run.cfg.share.push_to_hub)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final


def _record_final_metrics(run: Run, metrics: dict) -> None:
    """Main process: print ``task.finish``'s metrics first (a failing write cannot lose them), then
    ``metrics.jsonl`` and the trackers."""
    if not metrics:
        return
    shown = (f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    print(" ".join(shown), flush=True)
    append_jsonl(run.out / "metrics.jsonl", {"step": run.step, **metrics})
    run.accelerator.log(metrics, step=run.step)


def _full_model(run: Run) -> nn.Module | None:
    """The trained transformer with all its weights, on the main process (None on the others): the
    unwrapped model itself, or under FSDP a fresh ``task.build_transformer()`` loaded with the gathered
    state dict (gathering is a collective: every process calls this)."""
    if not run.fsdp:
        return run.accelerator.unwrap_model(run.transformer) if run.accelerator.is_main_process else None
    state_dict = run.accelerator.get_state_dict(run.transformer)  # full weights on the main process
    if not run.accelerator.is_main_process:
        return None
    model = run.task.build_transformer()
    model.load_state_dict(state_dict)
    return model.to(run.accelerator.device)  # where the task's frozen parts are (end-of-run sampling)


def save_final_folder(task: TrainTask, model: nn.Module, final: Path) -> None:
    """``task.save_final`` into a marked temporary sibling, with no local path in its configs and a model
    card (:mod:`mhla_gen.train.card`), then put it in place of ``final``: a failure while saving leaves the
    previous ``final/`` (if any) whole."""
    tmp = fresh_temp(final, "model", "output_dir (its final/)")
    task.save_final(model, tmp)
    scrub_local_paths(tmp)
    _write_card(task, model, tmp)
    write_marker(tmp, "model", **task.model_record())
    replace_with(tmp, final, "model", "output_dir (its final/)")


def _push(final: Path, repo_id: str | None) -> None:
    """``share.push_to_hub``: upload the finished ``final/``; a failed upload says how to retry it."""
    if not repo_id:
        return
    try:
        push_to_hub(final, repo_id)
    except Exception as err:
        raise RuntimeError(f"share.push_to_hub={repo_id}: uploading {final} failed ({type(err).__name__}: "
                           f"{err}); the run itself is complete: retry with "
                           f"mhla_gen.integration.cards.push_to_hub({str(final)!r}, {repo_id!r})") from err


def _write_card(task: TrainTask, model: nn.Module, folder: Path) -> None:
    """The folder's model card; a failure there is reported and never costs the trained weights."""
    try:
        write_run_card(task, model, folder)
    except Exception as err:  # noqa: BLE001 - the weights matter more than their description
        logger.warning("%s: no model card written (%s: %s)", folder, type(err).__name__, err)


class _ema_weights:
    """Context: the EMA weights in ``params`` inside, the trained ones back afterwards."""

    def __init__(self, ema, params):
        self.ema, self.params = ema, list(params)

    def __enter__(self):
        if self.ema is not None and self.params:
            self.ema.store(self.params)
            self.ema.copy_to(self.params)

    def __exit__(self, *exc):
        if self.ema is not None and self.params:
            self.ema.restore(self.params)


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested config -> flat ``a.b`` keys with tracker-friendly values (TensorBoard hparams)."""
    flat = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flat(v, key + "."))
        else:
            flat[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return flat
