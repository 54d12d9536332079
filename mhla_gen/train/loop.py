"""The one Accelerate training loop shared by DiT, SANA and Wan; a :class:`TrainTask` supplies the rest.

    cfg -> Accelerator -> task.build_transformer / build_dataset -> AdamW (+ EMA) -> prepare
        -> resume (atomic checkpoint, seeded sampler + skip_first_batches, step count)
        -> loop: task.loss -> backward -> clip -> step -> clamp_mixing_ -> EMA -> log / checkpoint / sample
        -> output_dir/final (EMA weights where used) -> task.finish (e.g. FID)

Exact resume: the data order comes from Accelerate's seedable sampler (epoch-seeded) plus
``skip_first_batches``; the per-step noise comes from :class:`StepRandom` seeded by the micro-step;
model, optimizer, LR scheduler, EMA (``register_for_checkpointing``) and RNG states come from
``accelerator.load_state``. A run killed with SIGKILL and resumed ends with the same weights.

Where a run starts (:func:`plan_start`): ``resume=latest`` continues from the newest checkpoint in
``output_dir``. Without one it starts at step 0, and the records of an interrupted earlier run (which
this run is about to redo) are dropped from ``metrics.jsonl``; a folder holding a *finished* run
(``final/``) is refused instead. In every case ``metrics.jsonl`` keeps only the rows up to the start step,
and TensorBoard hides the events past it (``SummaryWriter(purge_step=start + 1)``). The output folder is
a folder this project marked as a run (:mod:`mhla_gen.folders`): any other non-empty folder is refused,
and ``final/`` is written in a temporary sibling and put in place when complete.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..folders import check_replaceable, check_temp, claim, fresh_temp, owned, replace_with, write_marker
from ..mixing import clamp_mixing_
from . import checkpoint as ckpt
from .config import ConfigError, RunConfig, config_to_dict, config_to_yaml
from .io import append_jsonl, atomic_write_text, read_jsonl
from .randomness import StepRandom

logger = logging.getLogger(__name__)

RUN_FOLDER = "run"  # the kind of folder an output_dir is (mhla_gen.folders.KINDS)


class TrainTask:
    """What one model family plugs into :func:`train`. Subclasses: DiT, SANA, Wan tasks."""

    name = "task"
    collate_fn = None

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def signature(self) -> dict:
        """Settings that decide the parameter shapes; a checkpoint made with others is refused."""
        raise NotImplementedError

    def build_transformer(self) -> nn.Module:
        """The transformer to train, MHLA installed (float32 master weights)."""
        raise NotImplementedError

    def build_dataset(self, accelerator) -> Dataset:
        """Training items (dicts of tensors). Caches are built here (main process first)."""
        raise NotImplementedError

    def validate(self) -> None:
        """Check every setting the run uses, also those needed only at the end (sampling, evaluation),
        before any work; raise :class:`ConfigError` naming the setting. Cheap: reads configs, lists files."""

    def count_items(self) -> int | None:
        """How many training items the data holds, from a listing (before any cache is built); None
        when unknown until the dataset is built."""
        return None

    def loss(self, model: nn.Module, batch: dict, rnd: StepRandom) -> torch.Tensor:
        """Scalar training loss of one micro-batch; every random draw goes through ``rnd``."""
        raise NotImplementedError

    def sample_images(self, transformer: nn.Module) -> tuple[list, int]:
        """``(PIL images, columns)`` for a sample grid, through the real diffusers pipeline."""
        return [], 1

    def finish(self, transformer: nn.Module, accelerator) -> dict:
        """End-of-run evaluation (main process, final weights); returns metrics to record."""
        return {}

    def save_final(self, transformer: nn.Module, folder: Path) -> None:
        """Write the final weights into ``folder`` (main process): ``save_pretrained`` by default."""
        transformer.save_pretrained(str(folder))

    def model_record(self) -> dict:
        """Facts recorded in ``final/``'s marker that later commands check against (e.g. DiT's classes)."""
        return {}


def trainable_parameters(transformer: nn.Module, which: str) -> list[nn.Parameter]:
    """``all``: every parameter; ``mhla``: only those of the MHLA processors; ``lora``: the LoRA adapter
    and the MHLA parameters (``mhla_gen.lora``). The others are frozen."""
    if which == "all":
        params = list(transformer.parameters())
    elif which == "lora":
        from ..lora import lora_training_parameters

        params = lora_training_parameters(transformer)
    else:
        from ..processors.base import MHLAProcessor

        params = [p for m in transformer.modules() if isinstance(m, MHLAProcessor) for p in m.parameters()]
        if not params:
            raise ValueError(
                "train.trainable=mhla but the transformer has no MHLA processors (model.attention=softmax?)"
            )
    keep = {id(p) for p in params}
    for p in transformer.parameters():
        p.requires_grad_(id(p) in keep)
    return params


def save_image_grid(images: list, columns: int, path: Path) -> None:
    """Tile PIL images into one PNG (written through a temp file)."""
    from PIL import Image

    if not images:
        return
    w, h = images[0].size
    rows = math.ceil(len(images) / columns)
    grid = Image.new(images[0].mode, (columns * w, rows * h))
    for i, img in enumerate(images):
        grid.paste(img, ((i % columns) * w, (i // columns) * h))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    grid.save(tmp)
    os.replace(tmp, path)


def _batches(loader, epoch: int, skip: int) -> Iterator:
    """Batches of ``epoch`` from batch ``skip`` on (resume mid-epoch), in the same order as uninterrupted."""
    from accelerate import skip_first_batches

    loader.set_epoch(epoch)  # SeedableRandomSampler: permutation seeded by seed + epoch
    return iter(skip_first_batches(loader, skip) if skip else loader)


def check_world_size(accelerator) -> None:
    """Fail fast when the launcher started several processes that Accelerate does not join into one job
    (they would each train alone, as rank 0, into the same output_dir)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and accelerator.num_processes == 1:
        raise ConfigError(
            f"WORLD_SIZE={world} but Accelerate sees a single process ({accelerator.distributed_type}): "
            f"each process would train alone into the same output_dir. On CPU, launch with "
            f"`ACCELERATE_USE_CPU=true torchrun --nproc_per_node {world} scripts/<script>.py ...` (gloo); "
            f"the DDP and FSDP launch configs need one GPU per process"
        )


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
            f"continue from; pass resume=none to train again from step 0 in this folder (its "
            f"metrics.jsonl, logs and final/ are replaced), or choose another output_dir"
        )
    newer = [p.name for p in ckpt.list_checkpoints(out) if ckpt.checkpoint_step(p) > start]
    if newer:
        raise ConfigError(
            f"resume={cfg.resume}: this run starts at step {start}, but output_dir={str(out)!r} holds "
            f"later checkpoints {newer} that a later resume=latest would continue from; move them away "
            f"or choose another output_dir"
        )
    return resume_from, start


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
    if owned(out, RUN_FOLDER, "output_dir"):
        check_replaceable(out / "final", "model", "output_dir (its final/)", vouched=True)
        check_temp(out / "final", "model", "output_dir (its final/)")


def save_final_folder(task: TrainTask, model: nn.Module, final: Path) -> None:
    """``task.save_final`` into a marked temporary sibling, then put it in place of ``final``: a failure
    while saving leaves the previous ``final/`` (if any) whole."""
    tmp = fresh_temp(final, "model", "output_dir (its final/)")
    task.save_final(model, tmp)
    write_marker(tmp, "model", **task.model_record())
    replace_with(tmp, final, "model", "output_dir (its final/)", vouched=True)


def prepare_output_dir(out: Path, start: int) -> None:
    """Main process: claim ``out`` as a run folder and keep only the ``metrics.jsonl`` rows up to
    ``start`` (the rows after it are written again by this run)."""
    claim(out, RUN_FOLDER, "output_dir")
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
        atomic_write_text(metrics, "".join(f"{_json(r)}\n" for r in kept))


def _num_workers(requested: int) -> int:
    """``train.num_workers``; -1 = min(4, CPUs this process may use)."""
    if requested >= 0:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(4, cpus)


def train(cfg: RunConfig, task: TrainTask) -> Path:
    """Run ``task`` with ``cfg``; returns ``output_dir/final``."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import DistributedType, ProjectConfiguration, set_seed
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    out = Path(cfg.output_dir)
    tc = cfg.train
    accelerator = Accelerator(
        gradient_accumulation_steps=tc.gradient_accumulation_steps,
        mixed_precision=tc.mixed_precision,
        log_with=list(cfg.log.trackers) or None,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
    )
    check_world_size(accelerator)
    per_step = accelerator.num_processes * tc.gradient_accumulation_steps
    if tc.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={tc.global_batch_size} is not divisible by processes x "
            f"accumulation steps = {per_step}"
        )
    local_batch = tc.global_batch_size // per_step
    task.validate()  # everything the run uses, before any work
    check_batch_fits(task.count_items(), local_batch * accelerator.num_processes, tc.global_batch_size)
    resume_from, step = plan_start(cfg, out)
    if resume_from is not None:
        ckpt.check_signature(resume_from, task.signature())
    check_run_folder(out)  # every process: all raise, none waits
    if tc.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    set_seed(cfg.seed)  # same on every process: identical initial weights
    if accelerator.is_main_process:
        prepare_output_dir(out, step)
        atomic_write_text(out / "config.yaml", config_to_yaml(cfg))  # before step 0
        ckpt.remove_partial(out)
    accelerator.wait_for_everyone()

    transformer = task.build_transformer()
    if tc.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.train()
    params = trainable_parameters(transformer, tc.trainable)
    optimizer = torch.optim.AdamW(
        params,
        lr=tc.learning_rate,
        betas=(tc.adam_beta1, tc.adam_beta2),
        eps=tc.adam_eps,
        weight_decay=tc.weight_decay,
    )
    # Accelerate steps a prepared scheduler once per process per step, hence the factor (as in diffusers)
    lr_scheduler = get_scheduler(
        "constant_with_warmup", optimizer, num_warmup_steps=tc.lr_warmup_steps * accelerator.num_processes
    )
    if tc.ema_decay > 0 and accelerator.distributed_type == DistributedType.FSDP:
        raise ValueError(
            "train.ema_decay > 0 is not supported under FSDP (sharded parameters); set train.ema_decay=0"
        )
    ema = EMAModel(params, decay=tc.ema_decay) if tc.ema_decay > 0 else None

    with accelerator.main_process_first():
        dataset = task.build_dataset(accelerator)
    loader = DataLoader(
        dataset,
        batch_size=local_batch,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(cfg.seed),
        num_workers=_num_workers(tc.num_workers),
        collate_fn=task.collate_fn,
        pin_memory=accelerator.device.type == "cuda",  # with non_blocking: batches copied asynchronously
    )
    check_batch_fits(len(dataset), local_batch, tc.global_batch_size)  # the loader drops partial batches
    transformer, optimizer, loader, lr_scheduler = accelerator.prepare(
        transformer, optimizer, loader, lr_scheduler
    )
    params = [p for p in transformer.parameters() if p.requires_grad]  # prepared (maybe wrapped) ones
    if ema is not None:
        ema.to(accelerator.device)
        accelerator.register_for_checkpointing(ema)

    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        logger.info("resumed from %s at step %d", resume_from, step)
    if accelerator.is_main_process and cfg.log.trackers:
        accelerator.init_trackers(  # purge_step: TensorBoard hides older events from the next step on
            task.name,
            config=_flat(config_to_dict(cfg)),
            init_kwargs={"tensorboard": {"purge_step": step + 1}},
        )

    def save(at_step: int) -> None:
        hook = None
        if cfg.debug.kill_during_checkpoint == at_step:
            hook = _kill_self  # the state is written, the rename is not done: a torn save
        ckpt.save_checkpoint(accelerator, out, at_step, task.signature(), tc.checkpoints_total_limit, hook)

    def sample(at_step: int) -> None:
        if accelerator.distributed_type == DistributedType.FSDP:
            logger.warning("sample grids are skipped under FSDP (sharded weights); sample from final/")
            return
        if accelerator.is_main_process:
            model = accelerator.unwrap_model(transformer)
            with _ema_weights(ema, params):
                model.eval()
                images, columns = task.sample_images(model)
                model.train()
            save_image_grid(images, columns, out / "samples" / f"step_{at_step:07d}.png")
        accelerator.wait_for_everyone()

    micro = step * tc.gradient_accumulation_steps
    epoch, skip = divmod(micro, len(loader))
    generator = torch.Generator(accelerator.device)  # re-seeded by every micro-step's StepRandom
    bar = tqdm(
        total=tc.max_steps, initial=step, disable=not accelerator.is_local_main_process, desc=task.name
    )
    loss_sum, loss_count, grad_norm, t_last, step_last = 0.0, 0, float("nan"), time.perf_counter(), step
    with logging_redirect_tqdm():  # log lines (checkpoint saves, warnings) print above the bar
        while step < tc.max_steps:
            for batch in _batches(loader, epoch, skip):
                rnd = StepRandom(
                    cfg.seed,
                    micro,
                    local_batch,
                    accelerator.process_index,
                    accelerator.num_processes,
                    accelerator.device,
                    generator,
                )
                with accelerator.accumulate(transformer):
                    loss = task.loss(transformer, batch, rnd)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(params, tc.max_grad_norm or float("inf"))
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                micro += 1
                loss_sum, loss_count = loss_sum + loss.detach().float(), loss_count + 1
                if not accelerator.sync_gradients:
                    continue
                step += 1
                clamp_mixing_(transformer)
                if ema is not None:
                    ema.step(params)
                bar.update(1)
                if step % cfg.log.every == 0 or step == tc.max_steps:
                    mean_loss = accelerator.reduce(loss_sum / loss_count, "mean").item()
                    now = time.perf_counter()
                    record = {
                        "step": step,
                        "loss": mean_loss,
                        "lr": lr_scheduler.get_last_lr()[0],
                        "grad_norm": float(grad_norm),
                        "steps_per_s": (step - step_last) / (now - t_last),
                        "num_processes": accelerator.num_processes,
                    }
                    loss_sum, loss_count, t_last, step_last = 0.0, 0, now, step
                    bar.set_postfix(loss=f"{mean_loss:.4f}")
                    accelerator.log(record, step=step)
                    if accelerator.is_main_process:
                        append_jsonl(out / "metrics.jsonl", record)
                if step % tc.checkpoint_every == 0 or step == tc.max_steps:
                    save(step)
                if cfg.debug.kill_after_step == step:
                    _kill_self()
                if cfg.log.sample_every and step % cfg.log.sample_every == 0 and step < tc.max_steps:
                    sample(step)
                if step >= tc.max_steps:
                    break
            epoch, skip = epoch + 1, 0
        bar.close()

    final = out / "final"
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(transformer)  # full weights on the main process (also FSDP)
    ema_params = params if accelerator.distributed_type != DistributedType.FSDP else []
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(transformer)
        if accelerator.distributed_type == DistributedType.FSDP:
            model = task.build_transformer()
            model.load_state_dict(state_dict)
        with _ema_weights(ema, ema_params):
            model.eval()
            save_final_folder(task, model, final)
    accelerator.wait_for_everyone()
    sample(step)  # after final/ is written: a failure while sampling cannot lose the trained weights
    if accelerator.is_main_process:
        with _ema_weights(ema, ema_params):
            model.eval()
            metrics = task.finish(model, accelerator)
        if metrics:
            append_jsonl(out / "metrics.jsonl", {"step": step, **metrics})
            accelerator.log(metrics, step=step)
            print(
                " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
            )
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final


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


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _json(record: dict) -> str:
    import json

    return json.dumps(record)


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
