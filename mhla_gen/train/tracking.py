"""What a run tells people: Accelerate's trackers (checked at start-up, sample grids sent to them), the
learning-rate schedule (diffusers' ``get_scheduler``) and the start-of-run summary.

Trackers are Accelerate's (``log.trackers``: ``tensorboard``, ``wandb``, ...): metrics go through
``accelerator.log``, sample grids through each tracker's ``log_images``. A tracker whose package is not
installed is a start-up error (Accelerate itself would only warn and train untracked). wandb writes into
``output_dir/logs`` and follows ``WANDB_MODE`` (``WANDB_MODE=offline``: no account, no network; sync
later with ``wandb sync``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import accelerate.utils
import numpy as np
from diffusers.optimization import get_scheduler

from .config import LR_SCHEDULERS, TRACKERS, ConfigError, RunConfig  # noqa: F401 - LR_SCHEDULERS re-exported

logger = logging.getLogger(__name__)



def check_trackers(names) -> None:
    """Every tracker in ``log.trackers`` is one Accelerate knows and its package imports; ConfigError
    naming the first that is not (before any work: Accelerate would warn and train untracked)."""
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"log.trackers: unknown tracker {name!r}; Accelerate's are {list(TRACKERS)}")
        if not getattr(accelerate.utils, f"is_{name}_available")():
            raise ConfigError(
                f"log.trackers={list(names)}: {name} is not installed (pip install {name}), or drop it "
                f"from log.trackers"
            )


def tracker_init_kwargs(out: Path, start_step: int) -> dict:
    """``accelerator.init_trackers`` arguments: TensorBoard hides events past the start step
    (``purge_step``); wandb writes under ``output_dir/logs`` (its mode from ``WANDB_MODE``)."""
    return {"tensorboard": {"purge_step": start_step + 1}, "wandb": {"dir": str(out / "logs")}}


def log_grid(accelerator, grid, step: int, name: str = "samples") -> None:
    """Send a sample grid (PIL image) to every tracker of the run that takes images (main process)."""
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":  # SummaryWriter.add_images wants one array (N, H, W, C)
            tracker.log_images({name: np.asarray(grid.convert("RGB"))[None]}, step, dataformats="NHWC")
        elif hasattr(tracker, "log_images"):
            try:
                tracker.log_images({name: [grid]}, step=step)
            except NotImplementedError:
                logger.info("tracker %s takes no images: sample grid not sent", tracker.name)


def make_lr_scheduler(tc, optimizer, num_processes: int):
    """``train.lr_scheduler`` with ``train.lr_warmup_steps`` warm-up over ``train.max_steps`` steps.
    Accelerate steps a prepared scheduler once per process per optimizer step, hence the factor (as in
    diffusers' training examples)."""
    return get_scheduler(
        tc.lr_scheduler,
        optimizer,
        num_warmup_steps=tc.lr_warmup_steps * num_processes,
        num_training_steps=tc.max_steps * num_processes,
        num_cycles=tc.lr_num_cycles,
        power=tc.lr_power,
    )


def run_summary(
    cfg: RunConfig, task_name: str, transformer, dataset_size: int, accelerator, local_batch: int,
    start_step: int, distributed: str,
) -> str:
    """The lines printed once when a run starts: model, parameters, data, steps, batches, precision,
    schedule, trackers and where the outputs go."""
    tc = cfg.train
    total = sum(p.numel() for p in transformer.parameters())
    trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    epochs = tc.max_steps * tc.global_batch_size / max(dataset_size, 1)
    attention = getattr(getattr(cfg, "model", None), "attention", "?")
    lines = [
        f"model          {type(transformer).__name__} ({task_name}, attention={attention})",
        f"parameters     {total:,} total, {trainable:,} trainable ({100 * trainable / max(total, 1):.1f}%, "
        f"train.trainable={tc.trainable})",
        f"data           {dataset_size:,} items",
        f"steps          {tc.max_steps:,} (from step {start_step:,}; {epochs:.2f} epochs)",
        f"batch          {local_batch} per device x {accelerator.num_processes} processes x "
        f"{tc.gradient_accumulation_steps} accumulation = {tc.global_batch_size} global",
        f"precision      mixed_precision={accelerator.mixed_precision}, {distributed}",
        f"optimizer      {tc.optimizer} lr={tc.learning_rate:g}, {tc.lr_scheduler} schedule, "
        f"{tc.lr_warmup_steps} warm-up steps, gradient clipping {tc.max_grad_norm or 'off'}, "
        f"EMA {tc.ema_decay if tc.ema_decay > 0 else 'off'}",
        f"trackers       {', '.join(cfg.log.trackers) or 'none'} (metrics also in metrics.jsonl)",
        f"output_dir     {Path(cfg.output_dir).resolve()}",
    ]
    return "run summary\n  " + "\n  ".join(lines)
