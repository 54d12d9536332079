"""Run arms x seeds of a DiT experiment (digits or shapes), evaluate checkpoints along the way, summarise.

One way to run the project's studies (``eval/study.py``: softmax / linear / MHLA and the ablations;
``eval/adaptation.py``: converting a trained model): every *arm* is a list of config overrides on top of
a base config; every (arm, seed) pair is one training run of ``mhla_gen.train.loop.train``, trained in
segments up to each evaluation step (``resume=latest`` continues exactly, so segments give the weights
of an uninterrupted run) and evaluated after each segment. Each evaluation is one JSON file:

    OUT/runs/<arm>/seed<k>/        the training run (a run folder, mhla_gen.outputs.folders)
    OUT/results/<arm>/seed<k>/step<n>.json

Resumable at that grain: a point whose JSON exists is never recomputed, a killed study continues from
the newest checkpoint of each run. Pairs run in parallel worker processes (``jobs``; one torch thread
each: these models are small, one thread per process uses 2 cores better than 2 threads per run).

Evaluation (:func:`evaluate_point`, scores from :mod:`studies.evidence`): FID of ``fid_samples``
samples (digits CNN or shapes CNN features) with its bootstrap spread, label accuracy, the shapes' exact
properties, the validation loss on fixed held-out triples (:mod:`studies.validation_loss`), the
training loss logged at that step, the mean attention rank / row entropy over layers, and the training
compute in FLOPs (:func:`training_compute`; with stage 1's and a teacher's for a conversion). Every arm and
seed samples from the same noise and labels (common random numbers), so differences between arms are
paired per sample set. Summaries (:func:`summarize`, :func:`paired`) give mean, min-max and a 95 %
t-interval over seeds, and per-seed paired differences between arms.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mhla_gen.errors import ConfigError
from mhla_gen.integration.loading import load_transformer
from mhla_gen.metrics.attention import attention_statistics, example_inputs
from mhla_gen.outputs.folders import claim, file_record, owned
from mhla_gen.outputs.locks import die_with_parent
from mhla_gen.train.config import DiTRunConfig, given_settings, load_config
from mhla_gen.train.dit import DiTTask
from mhla_gen.train.dit_flops import train_flops_per_image
from mhla_gen.train.io import atomic_write_text, read_jsonl
from mhla_gen.train.linearize import TransferTask, stage1_schema
from mhla_gen.train.loop import train

from .evidence import SAMPLE_SEED, SHAPES_SCORED, DataScores, interval
from .folders import check_runner
from .validation_loss import bucket_means, triple_losses, validation_set

logger = logging.getLogger(__name__)

RESULT_KIND = "experiment_point"  # the record in each result JSON (mhla_gen.outputs.folders.file_record)
# Validation triples per evaluation point: 256 per timestep bucket (4 buckets), so a bucket's own noise is
# small (until 2026-11-28: 512, 128 per bucket; the runs of docs/results/evidence.md had 256, 64 a bucket)
VAL_TRIPLES = 1024

# How every run on the shapes trains, in both studies and every arm alike (docs/results/evidence.md,
# 2026-11-26): with the digits' learning rate (1e-3) and the plain ε loss, the studies' 256-token DiT
# still draws class-coloured speckle after 2400 steps; with 3e-3 and Min-SNR-5 weighting it draws
# class-coloured blobs in the class's layout by step 1200. Without clipping one softmax seed of three
# diverged at step ~2240; clipped at norm 1 that seed did not (and drew the shapes best).
SHAPES_RECIPE = ("train.learning_rate=3e-3", "diffusion.snr_gamma=5", "train.max_grad_norm=1.0")


@dataclass(frozen=True)
class Arm:
    """One configuration of an experiment: ``overrides`` on top of the base config; with ``stage1`` (the
    overrides of a ``scripts/linearize.py`` run on the same base), the run starts from that run's
    ``final/`` (``model.init_from``), stage 1 being run once per seed and shared by the arms that name it."""

    name: str
    overrides: tuple[str, ...] = ()
    group: str = "main"
    stage1: tuple[str, ...] | None = None


@dataclass
class Job:
    """One (arm, seed) training run and its evaluation points; picklable (worker processes)."""

    arm: str
    seed: int
    config: str  # the base YAML
    overrides: list[str]  # base + arm overrides (without output_dir / seed / max_steps)
    steps: list[int]  # evaluation steps, increasing; the last is the budget
    run_dir: str
    result_dir: str
    fid_samples: int
    extra: dict = field(default_factory=dict)  # copied into every result record (e.g. teacher_flops)
    stage1: list[str] | None = None  # linearize overrides (without output_dir / seed)
    stage1_dir: str = ""  # where that stage-1 run lives (shared by the jobs with the same stage 1 and seed)
    val_triples: int = VAL_TRIPLES  # fixed held-out (image, timestep, noise) triples of the validation loss
    device: str = "cpu"  # where the evaluation runs (training: wherever Accelerate puts it)
    sample_at: list[int] | None = None  # the steps whose evaluation draws and scores samples (None: every)
    attention_stats: bool = True  # the attention maps' rank and entropy (N x N maps: small N only)
    checkpoint_every: int = 0  # 0: the evaluation steps' gcd (irregular steps: set it, or every gcd step)


def result_path(job: Job, step: int) -> Path:
    return Path(job.result_dir) / f"step{step:07d}.json"


def stage1_report(job: Job) -> Path:
    return Path(job.stage1_dir) / "transfer.json"


def run_stage1(job: Job) -> dict:
    """The job's stage-1 run (``scripts/linearize.py``), unless its report exists; returns the report."""
    if not stage1_report(job).is_file():
        cfg = load_config(stage1_schema(DiTTask.base), job.config, [
            *job.stage1, f"output_dir={job.stage1_dir}", f"seed={job.seed}", "resume=latest",
            "eval.fid_num_samples=0",
        ])
        train(cfg, TransferTask(cfg, DiTTask(cfg)))
        _reset_accelerate()
    return json.loads(stage1_report(job).read_text())


def stage1_summary(report: dict) -> dict:
    """What a result record keeps of its stage-1 report: cost (steps, seconds, teacher-forward
    equivalents, FLOPs: :class:`mhla_gen.metrics.flops.Conversion`), the mean layer error before / after and
    the end-to-end output error of the plain conversion and of the final stage-1 model."""
    keys = ("steps", "wall_seconds", "teacher_forward_equivalents", "softmax_layers")
    flops = report["teacher_forward_equivalents"] * report["teacher_forward_flops"] if (
        "teacher_forward_flops" in report) else math.nan  # a report of before 2026-11-28 may lack it
    return {**{k: report[k] for k in keys}, "flops": flops,
            "error_before": float(np.mean(list(report["errors_before"].values()))),
            "error_after": float(np.mean(list(report["errors_after"].values()))),
            **{k: report[k] for k in ("end_to_end_before", "end_to_end_final") if k in report}}


def run_job(job: Job) -> list[dict]:
    """Train ``job`` up to each evaluation step in turn and evaluate there (step 0: the model it starts
    from); skip points already done."""
    records = []
    for step in job.steps:
        path = result_path(job, step)
        if path.is_file():
            records.append(json.loads(path.read_text()))
            continue
        cfg = job_config(job, max(step, 1))
        start = time.perf_counter()
        if step == 0:
            record = evaluate_point(job, cfg, 0, DiTTask(cfg).build_transformer().eval())
        else:
            train(cfg, DiTTask(cfg))
            _reset_accelerate()
            record = evaluate_point(job, cfg, step)
        record["segment_seconds"] = time.perf_counter() - start
        if job.stage1:
            record["stage1"] = stage1_summary(json.loads(stage1_report(job).read_text()))
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({**record, **file_record(RESULT_KIND)}, indent=1))
        logger.info("%s seed %d step %d: FID %.2f, val loss %.4f", job.arm, job.seed, step, record["fid"],
                    record["val_loss"])
        records.append(record)
    return records


def job_config(job: Job, step: int) -> DiTRunConfig:
    """The run's config for the segment that ends at ``step`` (checkpoints at every evaluation step)."""
    every = job.checkpoint_every or math.gcd(*[s for s in job.steps if s > 0]) or 1  # 1: step 0 alone
    start = [f"model.init_from={Path(job.stage1_dir) / 'final'}"] if job.stage1 else []
    return load_config(DiTRunConfig, job.config, [
        *job.overrides, *start, f"output_dir={job.run_dir}", f"seed={job.seed}", f"train.max_steps={step}",
        f"train.checkpoint_every={every}", "train.checkpoints_total_limit=1", "resume=latest",
        "eval.fid_num_samples=0",
    ])


def _reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; the next segment builds a fresh Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@torch.no_grad()
def evaluate_point(job: Job, cfg: DiTRunConfig, step: int, transformer=None) -> dict:
    """Scores of ``transformer`` (default: the run's ``final/``) at ``step``, on ``job.device`` (under the
    run's ``train.mixed_precision`` autocast, CPU too): FID with its bootstrap spread, label accuracy (and
    the shapes' exact properties), the validation loss on fixed held-out triples, the logged training
    loss and attention statistics. Samples come from one seed and one label list for every arm and seed
    (common random numbers, :data:`studies.evidence.SAMPLE_SEED`); the first 100 (ten of each class)
    are kept as ``step<n>_samples.npy``, the sample features, per-triple validation losses and
    per-sample scores as ``step<n>_features.npz`` (``pool``, ``val`` and
    :data:`studies.evidence.PER_SAMPLE`'s keys: what the paired intervals resample,
    :class:`studies.evidence.SampleSets`). At a step outside ``job.sample_at`` no samples are drawn: the
    sample scores are NaN and the arrays hold ``val`` alone."""
    transformer = transformer if transformer is not None else load_transformer(Path(job.run_dir) / "final")
    transformer = transformer.to(job.device)
    task, scores = DiTTask(cfg), DataScores(cfg.data.source, cfg.data.resolution)
    with _autocast(job, cfg):
        sample_scores, arrays, sample_seconds = _sample_scores(job, task, scores, transformer, step)
        held, held_labels = scores.held_out()
        timesteps = task.scheduler.config.num_train_timesteps
        triples = validation_set(held, held_labels, job.val_triples, timesteps)
        losses = triple_losses(transformer, task.scheduler, triples)
        stats = attention_summary(transformer, scores, job.seed) if job.attention_stats else dict(
            rank=math.nan, tokens=math.nan, entropy=math.nan, max_entropy=math.nan)
    result_path(job, step).parent.mkdir(parents=True, exist_ok=True)
    np.savez(result_path(job, step).with_name(f"step{step:07d}_features.npz"), val=losses, **arrays)
    metrics = Path(job.run_dir) / "metrics.jsonl"
    records = read_jsonl(metrics) if metrics.is_file() else []  # none before the first step
    logged = [r for r in records if "loss" in r and r["step"] <= step]
    window = [r["loss"] for r in logged[-5:]]  # the last few logged losses: one batch is noisy
    return {
        "arm": job.arm, "seed": job.seed, "step": step, **job.extra, "data": cfg.data.source,
        "resolution": cfg.data.resolution,
        **sample_scores, **bucket_means(losses),
        "loss": float(np.mean(window)) if window else math.nan,
        "attention_rank": stats["rank"], "attention_tokens": stats["tokens"],
        "attention_entropy": stats["entropy"], "max_entropy": stats["max_entropy"],
        "train_images_per_s": float(np.median([r["steps_per_s"] for r in logged[1:]] or [math.nan]))
        * cfg.train.global_batch_size,
        "sample_images_per_s": job.fid_samples / sample_seconds if sample_seconds else math.nan,
        "parameters": sum(p.numel() for p in transformer.parameters()),
        **training_compute(cfg, step),
        "fid_samples": job.fid_samples, "val_triples": job.val_triples, "sample_seed": SAMPLE_SEED,
    }


def training_compute(cfg: DiTRunConfig, step: int) -> dict:
    """The run's training compute up to ``step``: ``flops_per_image`` (one training step per image,
    :func:`mhla_gen.train.dit_flops.train_flops_per_image`), ``batch`` and ``train_flops`` (step x batch x
    flops_per_image: this run's own steps; a conversion's stage 1 and teacher are in ``stage1.flops``
    and, where the runner gives it in ``Job.extra``, ``teacher_flops``:
    :class:`mhla_gen.metrics.flops.Conversion` adds them up)."""
    per_image = train_flops_per_image(cfg)["train"]
    batch = cfg.train.global_batch_size
    return {"flops_per_image": per_image, "batch": batch, "train_flops": step * batch * per_image}


# the sample scores of a point that draws no samples (Job.sample_at)
UNSAMPLED = ("fid", "fid_bootstrap_sd", "label_accuracy")


def _sample_scores(job: Job, task: DiTTask, scores: DataScores, transformer, step: int
                   ) -> tuple[dict, dict, float]:
    """``(summary, per-sample arrays with "pool", sampling seconds)`` of ``job.fid_samples`` samples drawn
    at ``step``; NaN scores, no arrays and 0 s where ``job.sample_at`` leaves the step out."""
    if job.sample_at is not None and step not in job.sample_at:
        names = UNSAMPLED + (SHAPES_SCORED if scores.source == "shapes" else ())
        return {name: math.nan for name in names}, {}, 0.0
    labels = [i % task.cfg.model.num_classes for i in range(job.fid_samples)]
    start = time.perf_counter()
    fake = task.generate(transformer, labels, seed=SAMPLE_SEED, output_type="pt")
    fake = fake.float().cpu()  # (N, C, R, R) in [0, 1]
    seconds = time.perf_counter() - start
    keep = (fake[:100].permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)  # (<=100, R, R, C)
    result_path(job, step).parent.mkdir(parents=True, exist_ok=True)
    np.save(result_path(job, step).with_name(f"step{step:07d}_samples.npy"), keep[..., 0] if
            keep.shape[-1] == 1 else keep)
    summary, features, per_sample = scores.score(fake, labels)
    return summary, {"pool": features, **per_sample}, seconds


def _autocast(job: Job, cfg: DiTRunConfig):
    """The run's mixed precision (``train.mixed_precision``) for its evaluation on ``job.device``, as
    Accelerate's autocast trained it; none for a run trained in fp32."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)
    return torch.autocast(torch.device(job.device).type, dtype=dtype) if dtype else contextlib.nullcontext()


def attention_summary(transformer, scores: DataScores, seed: int) -> dict:
    """Rank and row entropy of the self-attention maps, averaged over layers, on 4 real images at t=500."""
    images, labels = scores.real()
    pick = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))[:4]
    kwargs = example_inputs(transformer, 4, scores.resolution, timestep=500, images=images[pick] * 2 - 1,
                            labels=labels[pick], seed=seed)
    stats = attention_statistics(transformer, lambda: transformer(**kwargs))
    return {"rank": float(np.mean([s["rank"] for s in stats])), "tokens": stats[0]["tokens"],
            "entropy": float(np.mean([s["entropy"] for s in stats])), "max_entropy": stats[0]["max_entropy"]}


# ------------------------------------------------------------------------------------------- running
def make_jobs(out: Path, config: str, base: list[str], arms: list[Arm], seeds: list[int], steps: list[int],
              fid_samples: int, extra: dict | None = None, val_triples: int = VAL_TRIPLES,
              train: tuple[str, ...] = ()) -> list[Job]:
    """One job per (arm, seed), its folders under ``out`` (``out`` itself must be ours, see
    :func:`run_jobs`). ``base`` applies to every run, ``train`` to the training runs only (not to stage
    1, which has its own schedule), before the arm's own overrides."""
    jobs = []
    for arm in arms:
        for seed in seeds:
            run, results = (str(out / part / arm.name / f"seed{seed}") for part in ("runs", "results"))
            job = Job(arm.name, seed, config, [*base, *train, *arm.overrides], sorted(steps), run, results,
                      fid_samples, {"group": arm.group, **(extra or {})}, val_triples=val_triples)
            if arm.stage1 is not None:
                job.stage1 = [*base, *arm.stage1]
                job.stage1_dir = str(out / "stage1" / _key(arm.stage1) / f"seed{seed}")
            jobs.append(job)
    return jobs


def _key(overrides: tuple[str, ...]) -> str:
    """A short name for a stage-1 setting (jobs with the same setting and seed share its run)."""
    return hashlib.sha256(json.dumps(list(overrides)).encode()).hexdigest()[:10]


# Not compared by check_settings: what job_config sets per segment, and the folders the weights start from
# (a study folder may be copied or moved, and with it the stage-1 runs its arms start from).
PER_SEGMENT = frozenset({"output_dir", "seed", "resume", "train.max_steps", "train.checkpoint_every",
                         "train.checkpoints_total_limit", "eval.fid_num_samples", "model.init_from",
                         "train.distill.teacher"})


def _plain(value):
    """A setting as its ``config.yaml`` reads back: plain containers, tuples as lists."""
    return json.loads(json.dumps(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value))


def _recorded(path: Path, load) -> dict:
    """``load(path)`` of a file a run wrote (its ``config.yaml``, a point's record), which must read as a
    mapping; ``ConfigError`` naming the file otherwise (edited or damaged by hand)."""
    try:
        found = load(path)
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"{path}: cannot be read ({type(err).__name__}: {err}); restore it or remove its "
                          "run") from None
    if not isinstance(found, dict) and not OmegaConf.is_dict(found):
        raise ConfigError(f"{path}: holds no mapping of settings; restore it or remove its run")
    return found


def changed_settings(job: Job) -> list[str]:
    """``"key: was -> now"`` for each setting of ``job`` (its config file and overrides; evaluation samples
    and triples) that differs from what its run's ``config.yaml`` and its written points record."""
    changed = []
    recorded = Path(job.run_dir) / "config.yaml"
    if recorded.is_file():
        cfg = job_config(job, job.steps[-1])
        was, now = _recorded(recorded, OmegaConf.load), OmegaConf.structured(cfg)
        for key in sorted(given_settings(cfg) - PER_SEGMENT):
            old, new = _plain(OmegaConf.select(was, key)), _plain(OmegaConf.select(now, key))
            if old is not None and old != new:  # None: a setting the run's version did not have
                changed.append(f"{key}: {old} -> {new}")
    for step in job.steps:
        path = result_path(job, step)
        point = _recorded(path, lambda p: json.loads(p.read_text())) if path.is_file() else {}
        for name, now in (("fid_samples", job.fid_samples), ("val_triples", job.val_triples)):
            if name in point and point[name] != now:
                changed.append(f"{name} (step {step}): {point[name]} -> {now}")
    return changed


def check_settings(out: Path, jobs: list[Job]) -> None:
    """Every run and point already under ``out`` was made with the settings ``jobs`` give: a command whose
    flags differ is refused before it writes, for its finished points would be kept and reported as if made
    with the new settings. More steps (a longer budget, more evaluation points) are not a change."""
    for job in jobs:
        changed = changed_settings(job)
        if changed:
            raise ConfigError(f"--out {str(out)!r}: {os.path.relpath(job.run_dir, out)} was made with other "
                              f"settings ({'; '.join(changed)}); pass the flags that made it, or a new --out")


def run_jobs(out: Path, kind: str, setting: str, jobs: list[Job], workers: int = 1,
             runner: str | None = None) -> list[dict]:
    """Claim ``out`` (a ``kind`` folder of ours: outputs.folders; ``runner``: a study folder of
    ``eval/<runner>.py``, :func:`studies.folders.claim_study`) and run ``jobs``, ``workers`` at a time
    in fresh processes (one torch thread each); returns every result record. ``ConfigError`` before any
    write when the runs or points under ``out`` were made with other settings (:func:`check_settings`)."""
    if runner:
        check_runner(out, runner, setting)
    if owned(out, kind, setting):  # a folder not ours is refused here, before any of it is read
        check_settings(out, jobs)
    claim(out, kind, setting, **({"runner": runner} if runner else {}))
    todo = [job for job in jobs if not all(result_path(job, s).is_file() for s in job.steps)]
    todo.sort(key=lambda job: job.seed)  # seed-major: a study stopped early holds paired runs of its arms
    logger.info("%d of %d runs to do (the others finished earlier)", len(todo), len(jobs))
    pending = {job.stage1_dir: job for job in todo if job.stage1 and not stage1_report(job).is_file()}
    stage1 = list(pending.values())
    _map(run_stage1, stage1, workers)  # first: stage-2 runs of several arms may start from one stage 1
    _map(run_job, todo, workers)
    return [json.loads(result_path(job, s).read_text()) for job in jobs for s in job.steps]


def finished_records(jobs: list[Job]) -> list[dict]:
    """The records of every job whose evaluation points all exist; runs nothing (a report of a study
    that is still running, or that was stopped early)."""
    done = [job for job in jobs if all(result_path(job, s).is_file() for s in job.steps)]
    return [json.loads(result_path(job, s).read_text()) for job in done for s in job.steps]


def finished_points(jobs: list[Job]) -> list[dict]:
    """The record of every evaluation point that exists, those of runs not finished included (a study
    stopped mid-run keeps its earlier points); runs nothing."""
    return [json.loads(result_path(job, s).read_text()) for job in jobs for s in job.steps
            if result_path(job, s).is_file()]


def study_records(out: Path, jobs: list[Job], workers: int, report_only: bool, runner: str) -> list[dict]:
    """:func:`run_jobs` on the ``--out`` study folder ``out`` of ``eval/<runner>.py``, or with
    ``report_only`` the records of the runs finished so far, training nothing (``out`` must then be a study
    folder of ours, and of that runner)."""
    if not report_only:
        return run_jobs(out, "study", "--out", jobs, workers, runner)
    check_runner(out, runner, "--out")
    ours = owned(out, "study", "--out")
    if ours:
        check_settings(out, jobs)
    records = finished_records(jobs) if ours else []
    if not records:
        raise ConfigError(f"--report-only: no finished run under --out {out}")
    return records


def _map(fn, jobs: list[Job], workers: int) -> None:
    """``fn(job)`` for every job, ``workers`` at a time in fresh processes (in this one when 1).

    ``concurrent.futures`` rather than ``multiprocessing.Pool``: a Pool whose worker dies or whose
    replacement worker fails to start waits forever (seen: a study idle for an hour after its last run),
    where an executor raises ``BrokenProcessPool`` and the command stops with the reason."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            fn(job)
        return
    fresh = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}  # one process per job
    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init,
                             initargs=(os.getpid(),), **fresh) as pool:
        for future in as_completed([pool.submit(fn, job) for job in jobs]):
            future.result()  # a failed run stops the study (its finished runs are kept: resumable)


def _worker_init(parent: int | None = None) -> None:
    die_with_parent(parent)  # Ctrl-C, SIGTERM or SIGKILL of the study: its workers stop too
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TQDM_DISABLE"] = "1"  # progress bars of parallel workers would interleave
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)


# ------------------------------------------------------------------------------------------ summaries
def summarize(records: list[dict], metric: str) -> dict[tuple[str, int], dict]:
    """``{(arm, step): interval over seeds of metric}``."""
    groups: dict[tuple[str, int], list[float]] = {}
    for r in records:  # records of earlier versions lack the newer metrics: NaN
        groups.setdefault((r["arm"], r["step"]), []).append(r.get(metric, math.nan))
    return {key: interval(values) for key, values in sorted(groups.items())}


ARM_STYLES, ARM_MARKERS = ("-", "--", ":", "-."), ("o", "s", "^", "D")  # arms 1-10, 11-20, ...


def plot_arm_bands(ax, stats: dict[tuple[str, int], dict], records: list[dict], alpha: float) -> None:
    """One line per arm of ``records`` (mean over seeds, :func:`summarize` ``stats``) with a band: the 95 %
    interval, or min-max where an interval is undefined (one seed). The colours repeat every 10 arms, so
    each further 10 get another line style and marker."""
    for i, arm in enumerate(dict.fromkeys(r["arm"] for r in records)):
        steps = sorted(s for a, s in stats if a == arm)
        mean = np.array([stats[(arm, s)]["mean"] for s in steps])
        half = np.array([stats[(arm, s)]["ci"] for s in steps])
        low, high = (mean - half, mean + half) if np.isfinite(half).all() else (
            [stats[(arm, s)]["min"] for s in steps], [stats[(arm, s)]["max"] for s in steps])
        style = i // 10 % len(ARM_STYLES)
        (line,) = ax.plot(steps, mean, ARM_STYLES[style], marker=ARM_MARKERS[style], label=arm)
        ax.fill_between(steps, low, high, alpha=alpha, color=line.get_color())


def paired(records: list[dict], arm: str, other: str, metric: str, step: int) -> dict:
    """Per-seed differences ``arm - other`` of ``metric`` at ``step`` (the same seed draws the same data
    order, noise and samples in both), their interval, and how many seeds favour each side."""
    by_seed = {(r["arm"], r["seed"]): r.get(metric, math.nan) for r in records if r["step"] == step}
    seeds = sorted(s for a, s in by_seed if a == arm and (other, s) in by_seed)
    diffs = [by_seed[(arm, s)] - by_seed[(other, s)] for s in seeds]
    return {**interval(diffs), "per_seed": dict(zip(seeds, diffs)), "negative": sum(d < 0 for d in diffs)}

