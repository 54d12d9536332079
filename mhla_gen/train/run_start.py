"""The training loop's first stage (:func:`start_run`): the Accelerator, every check, where the run
starts (a checkpoint to resume or step 0), then the output folder claimed and its ``config.yaml``
written. Nothing is written before the checks pass (:mod:`mhla_gen.train.loop` has the stages)."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration, set_seed

from ..integration.cards import check_push_target
from ..outputs.folders import (
    check_apart,
    check_replaceable,
    check_temp,
    claim,
    input_record,
    owned,
)
from ..outputs.locks import die_with_launcher
from . import checkpoint as ckpt
from .config import (
    CHANGED_DEFAULTS,
    ConfigError,
    RunConfig,
    TrainConfig,
    config_to_yaml,
    given_settings,
)
from .distributed import check_fsdp, check_launcher, check_world_size, is_sharded, launcher_precision_note
from .io import atomic_write_text, read_jsonl
from .optimizers import check_optimizer
from .task import Run, TrainCallback, TrainTask
from .tracking import check_trackers

logger = logging.getLogger(__name__)

RUN_FOLDER = "run"  # the kind of folder an output_dir is (mhla_gen.outputs.folders.KINDS)


def start_run(cfg: RunConfig, task: TrainTask, callbacks: Sequence[TrainCallback] = ()) -> Run:
    """The Accelerator, every check (raising before anything is written), where the run starts, then
    ``output_dir`` claimed with its ``config.yaml`` (main process) and the global seed set."""
    out = Path(cfg.output_dir).expanduser()
    check_launcher()  # DeepSpeed: refused before Accelerate starts it
    die_with_launcher()  # a rank of torchrun / accelerate launch stops with it (SIGKILL included)
    check_trackers(cfg.log.trackers)  # Accelerate would only warn about a missing package
    check_optimizer(cfg.train)  # its package imports
    check_push_target(cfg.share.push_to_hub, "share.push_to_hub")  # a repo id and a token to push with
    if (note := launcher_precision_note(cfg.train.mixed_precision)) is not None:
        logger.warning(note)
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
    check_written_apart(out, inputs, task.written_inside())  # a cache is not the run folder
    check_batch_fits(task.count_items(), local_batch * accelerator.num_processes, cfg.train.global_batch_size)
    resume_from, step = plan_start(cfg, out)
    if resume_from is not None:
        ckpt.check_signature(resume_from, task.signature())
        ckpt.check_training(resume_from, cfg)
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


def check_written_apart(out: Path, inputs: dict[str, str | None], written: tuple[str, ...]) -> None:
    """``ConfigError`` when a folder the run writes besides ``output_dir`` (``written``: settings of
    :meth:`TrainTask.written_inside`, e.g. ``data.cache_dir``, teacher-sampled ``data.path``) is or
    contains ``output_dir``. Compared as resolved paths also while they do not exist yet:
    :func:`~mhla_gen.outputs.folders.check_apart` skips absent paths, and the run would create
    ``output_dir`` (marker, ``config.yaml``) before that folder's own writer refused it."""
    run_folder = out.expanduser().resolve()
    for setting in written:
        if not inputs.get(setting):
            continue
        folder = Path(inputs[setting]).expanduser().resolve()
        if folder == run_folder or folder in run_folder.parents:
            raise ConfigError(
                f"{setting}={inputs[setting]!r} {'is' if folder == run_folder else 'contains'} "
                f"output_dir={str(out)!r}: the run writes it as a folder of its own (inside output_dir is "
                f"fine); nothing was changed: choose another {setting}"
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
        ConfigError: ``resume=latest`` without a checkpoint in a folder that holds a finished run, a
            damaged checkpoint to resume, a ``train.max_steps`` below its step, or checkpoints in
            ``output_dir`` newer than the start step (a later ``resume=latest`` would continue from them
            instead of from this run).
    """
    resume_from = ckpt.resolve_resume(cfg.resume, out)
    if resume_from is not None:
        ckpt.check_intact(resume_from, f"resume={cfg.resume}")
    start = ckpt.read_state(resume_from)["step"] if resume_from is not None else 0
    if start > cfg.train.max_steps:
        raise ConfigError(
            f"train.max_steps={cfg.train.max_steps} is below step {start} of the checkpoint this run resumes "
            f"({str(resume_from)!r}, resume={cfg.resume}); nothing was changed: give train.max_steps >= "
            f"{start}, or start anew in another output_dir"
        )
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
