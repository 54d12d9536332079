"""The one Accelerate training loop shared by DiT, SANA and Wan; a :class:`TrainTask` supplies the rest.

:func:`train` runs four stages, top to bottom, sharing one :class:`Run` (the first in
:mod:`mhla_gen.train.run_start`; :class:`TrainTask`, :class:`Run` and :class:`TrainCallback` in
:mod:`mhla_gen.train.task`):

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
``accelerator.load_state``. A run killed with SIGKILL and resumed ends with the same weights (on a GPU,
up to the last bits that kernels summing in no fixed order change in any two runs).

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

import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from accelerate import skip_first_batches
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..integration.cards import push_to_hub, scrub_local_paths
from ..ops.mixing import clamp_mixing_
from ..outputs.folders import (
    fresh_temp,
    replace_with,
    write_marker,
)
from ..outputs.locks import release
from . import checkpoint as ckpt
from .card import write_run_card
from .config import (
    ConfigError,
    RunConfig,
    config_to_dict,
)
from .distill import Distiller
from .distributed import GatheredEMA, set_fsdp_units
from .io import append_jsonl
from .optimizers import make_optimizer
from .randomness import StepRandom
from .run_start import check_batch_fits, start_run
from .task import Run, TrainCallback, TrainTask
from .tracking import log_grid, make_lr_scheduler, run_summary, tracker_init_kwargs

logger = logging.getLogger(__name__)


def train(cfg: RunConfig, task: TrainTask, callbacks: Sequence[TrainCallback] = ()) -> Path:
    """Run ``task`` with ``cfg`` (stages in the module docstring); returns ``output_dir/final``."""
    run = start_run(cfg, task, callbacks)
    try:
        build(run)
        run_steps(run)
        return finish(run)
    finally:
        release(run.out)  # the output folder's lock (outputs.locks); an exit of any kind also ends it


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
        ckpt.save_checkpoint(run.accelerator, run.out, run.step, run.task.signature(), limit, staged,
                             training=ckpt.training_record(cfg))
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
        model = final if at_end else plain_model(accelerator, run.transformer)
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


def plain_model(accelerator, transformer: nn.Module) -> nn.Module:
    """The model ``accelerator.prepare`` wrapped, unwrapped: without DDP and without the ``torch.compile``
    wrapper that ``accelerate launch --dynamo_backend ...`` adds (the same module and weights). Sample
    grids run it eagerly (their shapes would recompile the training graph) and saving, cards and
    pushing see the model's own class."""
    return accelerator.unwrap_model(transformer, keep_torch_compile=False)


def _full_model(run: Run) -> nn.Module | None:
    """The trained transformer with all its weights, on the main process (None on the others): the
    unwrapped model itself, or under FSDP a fresh ``task.build_transformer()`` loaded with the gathered
    state dict (gathering is a collective: every process calls this)."""
    if not run.fsdp:
        return plain_model(run.accelerator, run.transformer) if run.accelerator.is_main_process else None
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
