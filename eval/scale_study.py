"""MHLA against softmax and linear attention where N ≫ M², on one GPU, at equal images and equal compute.

    python eval/scale_study.py --sizing-only --sizing OUT/sizing.json          # ~30 s: images/s per arm, N
    python eval/scale_study.py --sizing OUT/sizing.json --seconds 80 --export OUT/scale_study
    python eval/scale_study.py --images 16384 --export OUT/scale_study         # a budget in images instead
    python eval/results.py render OUT/scale_study/record.npz --out TABLES      # the tables from the record
    python eval/scale_study.py --smoke --out /tmp/s                            # CPU, seconds: the plumbing

eval/study.py answered MHLA against softmax at N = M² (256 tokens, 4x4 blocks). Here the drawn shapes
(mhla_gen.data.shapes) are 64x64 and 128x128 pixels, patch 2: 1024 and 4096 tokens with 4x4 blocks, so
N = 4 M² and 16 M². The arms are eval/study.py's: ``softmax`` (SDPA, FlashAttention on a GPU), ``mhla``
(the registered op: Triton on CUDA) and ``linear`` (MHLA with one block). The model is one the GPU runs
efficiently: DiT with hidden 256, depth 8, 4 heads of 64, bf16 autocast; the shapes' recipe
(studies.experiments.SHAPES_RECIPE) as in every shapes study.

Budgets. The softmax arm (the reference) trains ``--images`` images per grid, or as many as fit
``--seconds`` of the device per grid given ``--sizing`` (images/s per arm and N, measured by
``--sizing-only``). Every arm is evaluated at the same log-spaced image counts (the reference's budget
halved ``--points - 1`` times: equal images) and trains on to the steps at which it has spent the
reference's training FLOPs at each of them (equal compute; FLOPs of a training step counted by
mhla_gen.metrics.flops, so MHLA and linear attention train more images than softmax for the same compute).
``--compute time`` matches measured seconds (``--sizing``) instead of FLOPs. Samples are drawn and scored
only at the two end points (equal images, equal compute); the validation loss is measured at every point.

Seeds run concurrently: every (arm, seed) run of a grid is its own process (``--jobs``, default all of a
grid's runs at once), sharing the GPU. Separate processes rather than one batched model: each run is the
project's own training loop (mhla_gen.train.loop, Accelerate) and evaluation, unchanged; a batched model
(torch.func.vmap over stacked weights) would need a vmap rule for the registered MHLA op and its own
loop. Processes share the device by time slices, and each hides the others' host work (a small model's
kernel launches), which a single process of a model this size leaves idle.

Decision. One primary metric, declared before any run (2026-11-28): the validation loss (1024 fixed
held-out triples) at the end of the budget at equal compute, the question MHLA's cost is for. At a few
minutes of one GPU the properties sit at their floor in every arm (the 256-token runs drew none before
step 1200), so a rate would read "neither"; the validation loss decides at any budget. Secondaries under
Holm's rule: the validation loss at equal images, the FID and the shapes' properties at both end points.

Records: ``--out`` holds the runs (checkpoints: large), their record ``record.npz`` (eval/results.py: the
points' metrics, commit, per-triple losses and per-sample scores; the sizing and the plan in its meta) and
``scale_study.md`` rendered from it, after each grid; ``--export DIR`` writes the same two files into
``DIR`` too (a few MB: what comes back from a lent GPU and is committed), and ``python eval/results.py
render DIR/record.npz`` renders the tables again from the record alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from studies import sibling
from studies.evidence import (
    RULES,
    Question,
    apply_holm,
    check_questions,
    compare,
    fmt_comparison,
    footnotes,
    interval,
)
from studies.experiments import SHAPES_RECIPE, VAL_TRIPLES, Arm, make_jobs, run_jobs

from mhla_gen.commands.cli import expand_path, run
from mhla_gen.configs import CONFIG_DIR
from mhla_gen.errors import ConfigError
from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit import DiTTask
from mhla_gen.train.dit_flops import train_flops_per_image
from mhla_gen.train.io import atomic_write_text

results = sibling("results")  # the record every table is rendered from

CONFIG = str(CONFIG_DIR / "dit_digits.yaml")  # eval/study.py's base config
MODEL = dict(hidden_size=256, depth=8, heads=4, patch_size=2)
TINY_MODEL = dict(hidden_size=16, depth=1, heads=2, patch_size=8)
GRIDS = {  # batch 16 at 4096 tokens: nine runs' activations fit one 141 GB H200 with room to spare
    "1024": dict(resolution=64, blocks=(4, 4), batch=32, fid_samples=100, sample_steps=10),
    "4096": dict(resolution=128, blocks=(4, 4), batch=16, fid_samples=100, sample_steps=10),
    "smoke": dict(resolution=32, blocks=(2, 2), batch=4, fid_samples=20, sample_steps=2, tiny=True,
                  val_triples=32, images=32),
}
ARMS = [Arm("softmax", ("model.attention=softmax",)), Arm("mhla", ("model.attention=mhla",)),
        Arm("linear", ("model.attention=linear",))]
REFERENCE = "softmax"  # the arm whose budget the others match
PRIMARY = "val_loss"  # declared 2026-11-28, before any run (module docstring): read at equal compute, end
QUESTIONS = [Question("MHLA against softmax", "mhla", "softmax", PRIMARY),
             Question("MHLA against linear", "mhla", "linear", PRIMARY)]
SIZING_FORMAT = "mhla_gen scale-study sizing"
REPORT = "scale_study.md"  # the tables, rendered from record.npz beside them
REPORT_MARK = "<!-- mhla_gen: scale-study report -->"  # the report's first line: ours to replace
RECORD = "record.npz"
PRECISION_NAMES = {"no": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}  # train.mixed_precision


# ------------------------------------------------------------------------------------------ configs
def grid_model(grid: dict) -> dict:
    return TINY_MODEL if grid.get("tiny") else MODEL


def base_overrides(grid: dict, precision: str, warmup: int = 50) -> list[str]:
    """The data, model and schedule of every run of ``grid`` (eval/study.py's, with ``precision``): the
    shapes' recipe with its learning rate scaled to the width (:data:`RECIPE`)."""
    return [
        "data.source=shapes", f"data.resolution={grid['resolution']}",
        f"mhla.blocks=[{grid['blocks'][0]},{grid['blocks'][1]}]",
        *(f"model.{k}={v}" for k, v in grid_model(grid).items()),
        f"train.global_batch_size={grid['batch']}", f"train.lr_warmup_steps={warmup}", "log.every=10",
        "log.trackers=[]", "log.num_samples=1", f"log.sample_steps={grid['sample_steps']}",
        f"train.mixed_precision={precision}", *RECIPE,
    ]


# The shapes' recipe (studies.experiments.SHAPES_RECIPE: lr 3e-3, Min-SNR-5, clipping at 1), its learning
# rate scaled for a model 4x wider than the CPU studies' (hidden 256 against 64; Adam's update of a hidden
# layer's output grows with its fan-in, so the rate goes about 1 / width: 3e-3 x 64/256 ~ 1e-3). Chosen
# 2026-11-28 before any run at this width, not tuned.
RECIPE = (*SHAPES_RECIPE, "train.learning_rate=1e-3")


def arm_config(grid: dict, arm: Arm, precision: str = "no") -> DiTRunConfig:
    return load_config(DiTRunConfig, CONFIG, [*base_overrides(grid, precision), *arm.overrides])


def tokens(grid: dict) -> int:
    return (grid["resolution"] // grid_model(grid)["patch_size"]) ** 2


# ------------------------------------------------------------------------------------------ budgets
def log_points(last: int, count: int) -> list[int]:
    """``count`` evaluation steps ``last / 2^(count-1), ..., last / 2, last`` (each at least 1, the
    duplicates of a short budget dropped); ``last`` should be a multiple of ``2^(count-1)``."""
    if last < 1 or count < 1:
        raise ValueError(f"need a budget >= 1 and >= 1 points, got {last} and {count}")
    return sorted({max(1, last >> k) for k in range(count)})


def equal_compute_steps(steps: list[int], ratio: float, unit: int) -> list[int]:
    """The steps at which an arm whose training step costs ``1 / ratio`` of the reference arm's (same
    batch) has spent what the reference spent at each of ``steps``: ``step * ratio``, rounded to a
    multiple of ``unit`` (at least ``unit``). The rounding moves a point by at most ``unit / 2`` steps:
    the tables state each point's own compute."""
    if ratio <= 0 or unit < 1:
        raise ValueError(f"need ratio > 0 and unit >= 1, got {ratio} and {unit}")
    return [max(unit, unit * round(s * ratio / unit)) for s in steps]


def images_for_seconds(seconds: float, seeds: int, cost: dict[str, tuple[float, float]],
                       multiple: int = 1) -> int:
    """The reference arm's training images that fit ``seconds`` of one device when every arm trains
    ``seeds`` runs, arm ``a`` training ``ratio_a`` times the reference's images at ``images_per_s_a``
    (``cost[a] = (ratio_a, images_per_s_a)``; the reference has ratio 1), the runs' times added (runs
    sharing a device overlap their host work, so this errs long); rounded down to ``multiple``."""
    per_image = seeds * sum(ratio / speed for ratio, speed in cost.values())  # device seconds
    images = int(seconds / per_image) // multiple * multiple
    if images < multiple:
        raise ValueError(f"{seconds:g} s fit {seconds / per_image:.0f} reference images, fewer than one "
                         f"budget unit of {multiple}")
    return images


def measure_training(build, batch: int, resolution: int, channels: int, device: str,
                     dtype: torch.dtype | None = None, seconds: float = 3.0, warmup: int = 3) -> dict:
    """Training images/s of ``build()`` on ``device``: forward (under autocast to ``dtype`` when given),
    the ε-loss backward, gradient clipping and an AdamW step on random pixels, after ``warmup`` steps
    (kernel compilation, allocator), timed for about ``seconds`` (at least 3 steps; CUDA synchronised).
    No data loading, EMA or logging: a bound on what the training loop reaches with the same model."""
    model = build().to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, resolution, resolution, generator=gen).to(device)  # (B, C, R, R)
    t = torch.randint(0, 1000, (batch,), generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    kind = torch.device(device).type
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)

    def step():
        with torch.autocast(kind, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x, timestep=t, class_labels=y).sample
        out.float()[:, :channels].square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    if kind == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    sync()
    steps, start = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - start < seconds:
        step()
        steps += 1
        if steps % 4 == 0:  # the host may not queue far ahead of the device: the clock reads both
            sync()
    sync()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if kind == "cuda" else math.nan
    return {"images_per_s": steps * batch / elapsed, "steps": steps, "seconds": elapsed, "peak_gib": peak}


# ------------------------------------------------------------------------------------------ sizing
def sizing(grids: list[str], device: str, precision: str, seconds: float) -> dict:
    """Training images/s and FLOPs per image of every arm at every grid (:func:`measure_training`: the
    model's step alone, one process), with the achieved TFLOP/s."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    rows = []
    for name in grids:
        grid = GRIDS[name]
        for arm in ARMS:
            cfg = arm_config(grid, arm, precision)
            flops = train_flops_per_image(cfg)["train"]
            speed = measure_training(DiTTask(cfg).build_transformer, grid["batch"],
                                     grid["resolution"], 3, device, dtype, seconds)
            rows.append({"grid": name, "tokens": tokens(grid), "arm": arm.name, "batch": grid["batch"],
                         "flops_per_image": flops, **speed, "tflops": speed["images_per_s"] * flops / 1e12})
            logging.info("sizing %s tokens %s: %.1f images/s", tokens(grid), arm.name, speed["images_per_s"])
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"format": SIZING_FORMAT, "device": device_name(device), "precision": precision,
            "model": {n: grid_model(GRIDS[n]) for n in grids}, "rows": rows}


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if torch.device(device).type == "cuda" else "cpu"


def read_sizing(path: Path, grids: list[str]) -> dict[tuple[str, str], float]:
    """``{(grid, arm): images/s}`` from a ``--sizing-only`` file, checked against this preset's model and
    batch (a file measured for another model is refused)."""
    if not path.is_file():
        raise FileNotFoundError(f"--sizing {str(path)!r} does not exist (write it with --sizing-only)")
    record = json.loads(path.read_text())
    if record.get("format") != SIZING_FORMAT:
        raise ConfigError(f"--sizing {str(path)!r} is not a sizing file of eval/scale_study.py")
    found = {(r["grid"], r["arm"]): r for r in record["rows"]}
    for name in grids:
        if record["model"].get(name) != grid_model(GRIDS[name]):
            raise ConfigError(f"--sizing {str(path)!r} measured grid {name} with model "
                              f"{record['model'].get(name)}, not {grid_model(GRIDS[name])}")
        for arm in ARMS:
            row = found.get((name, arm.name))
            if row is None or row["batch"] != GRIDS[name]["batch"]:
                raise ConfigError(f"--sizing {str(path)!r} has no {arm.name} row at grid {name} with batch "
                                  f"{GRIDS[name]['batch']}")
    return {key: row["images_per_s"] for key, row in found.items()}


# ------------------------------------------------------------------------------------------ plan
def grid_plan(name: str, args, speed: dict | None) -> dict:
    """One grid's budget: FLOPs per image and the compute ratio of each arm, the reference's steps
    (equal images) and each arm's equal-compute steps."""
    grid = GRIDS[name]
    flops = {arm.name: train_flops_per_image(arm_config(grid, arm))["train"] for arm in ARMS}
    if args.compute == "time":
        ratio = {a: speed[(name, a)] / speed[(name, REFERENCE)] for a in flops}
    else:
        ratio = {a: flops[REFERENCE] / flops[a] for a in flops}
    unit = grid["batch"] << (args.points - 1)  # the budget halves evenly
    if args.images or grid.get("images"):
        images = max(unit, (args.images or grid["images"]) // unit * unit)
    else:
        cost = {a: (ratio[a], speed[(name, a)]) for a in flops}
        images = images_for_seconds(args.seconds, args.seeds, cost, unit)
    steps = log_points(images // grid["batch"], args.points)
    return {"grid": name, "tokens": tokens(grid), "batch": grid["batch"], "flops_per_image": flops,
            "ratio": ratio, "images": images, "images_steps": steps,
            "compute_steps": {a: equal_compute_steps(steps, ratio[a], 1) for a in flops}}


def plan_jobs(args, plans: dict[str, dict]) -> dict[str, list]:
    """Every (arm, seed) run of each grid, evaluated at its equal-images and equal-compute steps."""
    jobs = {}
    seeds, commit = list(range(args.first_seed, args.first_seed + args.seeds)), results.code_commit()
    for name, p in plans.items():
        grid, jobs[name] = GRIDS[name], []
        for arm in ARMS:
            own = p["compute_steps"][arm.name]
            extra = {"grid": name, "tokens": p["tokens"], "blocks": list(grid["blocks"]),
                     "images_steps": p["images_steps"], "compute_steps": own,  # FLOPs: the point's own
                     "commit": commit}
            warmup = min(50, max(1, p["images_steps"][-1] // 10))  # every arm alike, whatever its budget
            base = base_overrides(grid, args.precision, warmup)
            found = make_jobs(args.out / name, CONFIG, base, [arm], seeds, sorted({*p["images_steps"], *own}),
                              grid["fid_samples"], extra, grid.get("val_triples", VAL_TRIPLES))
            for job in found:
                job.device, job.attention_stats = args.device, False
                job.sample_at = [p["images_steps"][-1], own[-1]]
                job.checkpoint_every = max(job.steps)  # a checkpoint at each segment's end only
            jobs[name] += found
    return jobs


# ------------------------------------------------------------------------------------------ report
def at_compute(records: list[dict]) -> list[dict]:
    """The records at equal compute, each labelled with the reference's step it matches (``step``; its
    own in ``result_step``, where its per-sample scores are found)."""
    out = []
    for r in records:
        own = r["compute_steps"]
        if r["step"] in own:
            out.append(dict(r, step=r["images_steps"][own.index(r["step"])], result_step=r["step"]))
    return out


def at_images(records: list[dict]) -> list[dict]:
    return [r for r in records if r["step"] in r["images_steps"]]


def cost_table(recs: list[dict]) -> str:
    """Per arm: FLOPs per training image, its compute ratio, steps at each end, the runs' own images/s."""
    lines = ["| arm | training GFLOPs / image | images per reference image at equal compute | steps (equal "
             "images, end) | steps (equal compute, end) | training images/s (the runs, median) |",
             "|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in recs):
        r0 = next(r for r in recs if r["arm"] == arm)
        speed = np.nanmedian([r["train_images_per_s"] for r in recs if r["arm"] == arm])
        ratio = r0["compute_steps"][-1] / r0["images_steps"][-1]
        lines.append(f"| {arm} | {r0['flops_per_image'] / 1e9:.4g} | {ratio:.2f} | {r0['images_steps'][-1]} "
                     f"| {r0['compute_steps'][-1]} | {speed:.0f} |")
    return "\n".join(lines) + "\n"


def curve_table(recs: list[dict]) -> str:
    """The validation loss at every evaluated point (mean ± 95 % t-interval over seeds)."""
    lines = ["| arm | step | images | training PFLOPs | val loss ↓ | seeds |", "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in recs:
        groups.setdefault((r["arm"], r["step"]), []).append(r)
    for (arm, step), rs in groups.items():
        s = interval([r["val_loss"] for r in rs])
        ci = "" if math.isnan(s["ci"]) else f" ± {s['ci']:.4f}"
        images = step * rs[0]["batch"]
        lines.append(f"| {arm} | {step} | {images} | {images * rs[0]['flops_per_image'] / 1e15:.3g} | "
                     f"{s['mean']:.4f}{ci} | {s['n']} |")
    return "\n".join(lines) + "\n"


METRICS = (  # (metric, header, decimals) of the decision table's columns
    ("val_loss", "val loss ↓", 4), ("fid", "FID ↓", 1), ("all_correct", "all 4 properties ↑", 3),
    ("count_accuracy", "count ↑", 3), ("colour_accuracy", "colour ↑", 3), ("shape_accuracy", "shape ↑", 3),
    ("symmetric_rate", "symmetric ↑", 3), ("symmetry_error", "symmetry error ↓", 3))


def decision_table(recs: list[dict], samples) -> str:
    """Each question at the end of the budget, read at equal compute and at equal images: the validation
    loss at equal compute is its primary; every other cell of its two rows is a secondary (Holm's rule
    over them)."""
    last = recs[0]["images_steps"][-1]
    readings = (("equal compute", at_compute(recs)), ("equal images", at_images(recs)))
    lines = [f"Paired by seed at the end of the budget (first minus second; {RULES}):", "",
             "| comparison | read at | seeds | " + " | ".join(h for _, h, _ in METRICS) + " |",
             "|---|---|---|" + "---|" * len(METRICS)]
    every = []
    for q in QUESTIONS:
        cells = apply_holm([compare(pool, q.arm, q.other, m, last, samples)
                            for _, pool in readings for m, _, _ in METRICS], primary=0)
        every += cells
        for k, (name, _) in enumerate(readings):
            row = cells[k * len(METRICS):(k + 1) * len(METRICS)]
            text = " | ".join(fmt_comparison(c, d) for c, (_, _, d) in zip(row, METRICS))
            lines.append(f"| {q.arm} − {q.other} | {name} | {row[0]['n']} | {text} |")
    return "\n".join(lines) + "\n" + footnotes(every) + "\n"


def along_table(recs: list[dict], samples) -> str:
    """The primary metric's paired difference at every budget point, at equal images and at equal
    compute: how the gap moves (exploratory: the decision is read at the end)."""
    lines = ["The validation-loss difference along the budget (exploratory; first minus second):", "",
             "| comparison | reference step | equal images | equal compute |", "|---|---|---|---|"]
    every = []
    for q in QUESTIONS:
        for step in recs[0]["images_steps"]:
            cells = [compare(pool, q.arm, q.other, PRIMARY, step, samples)
                     for pool in (at_images(recs), at_compute(recs))]
            every += cells
            row = " | ".join(fmt_comparison(c, 4) for c in cells)
            lines.append(f"| {q.arm} − {q.other} | {step} | {row} |")
    return "\n".join(lines) + "\n" + footnotes(every) + "\n"


def report(records: list[dict], samples, heading: str) -> str:
    """Every grid's tables (per-sample scores from ``samples``: a record's, eval/results.py)."""
    text = [heading]
    for name in dict.fromkeys(r["grid"] for r in records):
        recs = [r for r in records if r["grid"] == name]
        r0 = recs[0]
        blocks = "x".join(map(str, r0["blocks"]))
        text += [f"## {r0['tokens']} tokens ({r0['resolution']}x{r0['resolution']} px, blocks {blocks}), "
                 f"batch {r0['batch']}", "", cost_table(recs), curve_table(recs),
                 decision_table(recs, samples), along_table(recs, samples)]
    return "\n".join(text)


def render(record, folder: Path) -> list[Path]:
    """``scale_study.md`` of a scale-study record (eval/results.py) in ``folder``, from the record alone."""
    meta = record.meta
    heading = (f"# MHLA / softmax / linear where N ≫ M²\n\n`{meta['command']}` — {meta['date']}, "
               f"{meta['device']} ({PRECISION_NAMES.get(meta['precision'], meta['precision'])}), "
               f"{results.how_it_ran(meta)}, "
               f"torch {meta['torch']}\n\n{results.commits_line(record.points)}\n")
    path = Path(folder) / REPORT
    atomic_write_text(path, f"{REPORT_MARK}\n{report(record.points, record.samples(), heading)}")
    return [path]


def write_record(args, records: list[dict], meta: dict, seconds: float) -> str:
    """The record of the points so far (``record.npz``) and the report rendered from it, in ``--out`` and
    in ``--export``; returns the report."""
    meta = {**meta, "report_only": False, "wall_seconds": seconds}
    record = results.build("scale_study", args.command, records, args.out, meta)
    for folder in filter(None, (args.out, args.export)):
        results.save(record, Path(folder) / RECORD)
        render(results.load(Path(folder) / RECORD), Path(folder))  # as regenerating from the file does
    return (Path(args.out) / REPORT).read_text()


# ------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=expand_path, default=None,
                        help="the runs (large; default: a new temporary folder, the records go to --export)")
    parser.add_argument("--export", type=expand_path, default=None, metavar="DIR",
                        help="write record.npz and scale_study.md into DIR too (the compact part of --out)")
    parser.add_argument("--grids", nargs="+", choices=["1024", "4096"], default=["1024", "4096"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--images", type=int, default=None, help="the reference arm's images per grid")
    parser.add_argument("--seconds", type=float, default=None,
                        help="device seconds of training per grid (with --sizing): sets --images")
    parser.add_argument("--sizing", type=expand_path, default=None, help="a --sizing-only file")
    parser.add_argument("--sizing-only", action="store_true", help="measure images/s into --sizing; no runs")
    parser.add_argument("--sizing-seconds", type=float, default=3.0, help="timing per arm and grid")
    parser.add_argument("--compute", choices=["flops", "time"], default="flops",
                        help="equal compute in counted FLOPs, or in measured seconds (--sizing)")
    parser.add_argument("--points", type=int, default=4, help="log-spaced evaluation points (factor 2)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at once (default: all of a grid's)")
    parser.add_argument("--device", default=None, help="default cuda (the smoke: cpu)")
    parser.add_argument("--smoke", action="store_true", help="CPU, seconds: a tiny model, one seed")
    args = parser.parse_args(argv)
    if args.smoke:
        args.grids, args.seeds, args.points = ["smoke"], min(args.seeds, 1), 2
        args.device, args.jobs = args.device or "cpu", args.jobs or 1
    args.device = args.device or "cuda"
    args.out = Path(args.out) if args.out else None
    args.precision = "bf16" if torch.device(args.device).type == "cuda" else "no"
    check_args(args)
    return args


def check_args(args) -> None:
    """Every refusal before any work."""
    for name in ("seeds", "points", "jobs", "images"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.sizing_only and args.sizing is None:
        raise ConfigError("--sizing-only writes its measurements to --sizing FILE: give one")
    if args.sizing_only or args.smoke:
        pass
    elif args.images is None and args.seconds is None:
        raise ConfigError("give a budget: --images N, or --seconds S with --sizing FILE")
    elif (args.seconds is not None or args.compute == "time") and args.sizing is None:
        raise ConfigError("--seconds and --compute time read measured images/s: give --sizing FILE")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: no CUDA device here (--smoke runs the plumbing on CPU)")
    if args.export is not None:
        check_export(Path(args.export))
    check_questions(QUESTIONS, (PRIMARY,), "eval/scale_study.py")


def check_export(folder: Path) -> None:
    """``--export`` may be new, or hold only this script's files (a record and a report of ours)."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--export {str(folder)!r} is a file; give a folder")
    if (folder / RECORD).exists():
        try:
            results.load(folder / RECORD)
        except (ConfigError, ValueError, OSError) as err:
            raise ConfigError(f"--export {str(folder)!r}: {RECORD} there is not a record of ours ({err}); "
                              "nothing was changed: choose another folder") from None
    report = folder / REPORT
    if report.exists() and report.read_text(errors="replace").split("\n", 1)[0] != REPORT_MARK:
        raise ConfigError(f"--export {str(folder)!r}: {str(report)!r} exists and was not written by this "
                          "script; nothing was changed: choose another folder")


def write_sizing(args) -> dict:
    path = Path(args.sizing)
    if path.exists() and json.loads(path.read_text() or "{}").get("format") != SIZING_FORMAT:
        raise ConfigError(f"--sizing {str(path)!r} exists and is not a sizing file of this script")
    measured = sizing(args.grids, args.device, args.precision, args.sizing_seconds)
    atomic_write_text(path, json.dumps(measured, indent=1))
    lines = ["| tokens | arm | batch | training images/s | GFLOPs / image | TFLOP/s | peak GiB |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['arm']} | {r['batch']} | {r['images_per_s']:.1f} | "
              f"{r['flops_per_image'] / 1e9:.4g} | {r['tflops']:.3g} | {r['peak_gib']:.1f} |"
              for r in measured["rows"]]
    print("\n".join(lines))
    return measured


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    if args.sizing_only:
        write_sizing(args)
        return []
    measured = json.loads(Path(args.sizing).read_text()) if args.sizing else None
    speed = read_sizing(Path(args.sizing), args.grids) if args.sizing else None
    plans = {name: grid_plan(name, args, speed) for name in args.grids}
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="mhla_scale_study_"))
        logging.info("runs in %s", args.out)
    jobs = plan_jobs(args, plans)
    args.command = "python eval/scale_study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    every = [job for name in args.grids for job in jobs[name]]
    meta = {"grids": args.grids, "plans": plans, "sizing": measured, "device": device_name(args.device),
            "precision": args.precision, "configs": results.configs(every),
            "jobs": args.jobs or max(len(jobs[name]) for name in args.grids)}
    start, records = time.perf_counter(), []
    for name in args.grids:  # grid after grid, the record written after each
        logging.info("grid %s: %s", name, json.dumps(plans[name]))
        records += run_jobs(args.out, "study", "--out", jobs[name], args.jobs or len(jobs[name]))
        text = write_record(args, records, meta, time.perf_counter() - start)
    print(text)
    return records


if __name__ == "__main__":
    run(main)
