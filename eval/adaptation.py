"""How fast a converted model recovers: a pretrained softmax (or linear-attention) DiT converted to MHLA in
different ways, each arm with the same stage-2 budget and data, on the embedded digits.

    python eval/adaptation.py                               # both grids, 3 seeds (3 teachers trained first)
    python eval/adaptation.py --teachers-from runs/study    # the study's softmax / linear runs: seed k's
    python eval/adaptation.py --teachers-from runs/a runs/b --seeds 6 --scratch   # teachers of 2 budgets
    python eval/adaptation.py --data shapes                 # the drawn shapes at 256 tokens
    python eval/adaptation.py --quick                       # CI-sized: about 10 min of 2 cores
    python eval/adaptation.py --smoke                       # seconds: a smoke test

Teachers: DiTs of the study's size (eval/study.py) trained on the digits with softmax and with linear
attention, one per seed (seed k's stage 1 and stage 2 start from teacher k: the teacher is part of the seed
unit, and a verdict needs 3 distinct teachers; :mod:`studies.teachers`): trained under OUT/teachers with
seed k, or taken from finished studies (``--teachers-from``: several folders, e.g. of different budgets;
each teacher's model and data checked against the grid's); only those the chosen arms start from. Every
record keeps its teacher and the teacher's training FLOPs (``teacher_flops``). Arms (stage 2 =
train_dit.py with ``model.init_from``, the same budget, data and seed in every arm):

* ``softmax-continued``: the softmax teacher trained on (the reference);
* ``linear-plain``: the teacher with global linear attention installed, trained (the paper's LA baseline);
* ``mhla-plain``: MHLA installed on the teacher, trained (the paper's conversion recipe);
* ``mhla-stage1``: stage 1 first (scripts/linearize.py, attention transfer), then stage 2;
* ``mhla-stage1-distill``: the same, stage 2 with output and attention distillation against the teacher;
* ``mhla-stage1-all``: stage 1 trains every parameter of the converted layers (``transfer.trainable=all``:
  q/k/v/out projections too), not only MHLA's own (mixing), then stage 2;
* ``mhla-stage1-e2e`` / ``mhla-stage1-all-e2e``: stage 1 with its end-to-end term
  (``transfer.output_weight=1``: the converted model's output error against the teacher's beside the
  per-layer errors), on MHLA's parameters / on every parameter of the converted layers, then stage 2;
* the stage-2 schedules, from ``mhla-stage1``'s stage 1 (group ``schedule``): ``stage2-no-warmup``,
  ``stage2-low-lr``, ``stage2-from-stage1-ema``, ``stage2-output-distill``, ``stage2-mhla-only`` and
  ``stage2-lora`` (LoRA-style: a rank-8 adapter on q/k/v/out plus MHLA's parameters) and
  ``stage2-lora-high-lr`` (the same at peak 1e-2); ``stage2-lora-after-all`` and
  ``stage2-no-warmup-after-all`` from the default stage 1 (every parameter, ``mhla-stage1-all``'s);
  ``mhla-plain-no-warmup``;
* ``hybrid-auto`` / ``hybrid-fixed`` (64 tokens): stage 1, then one softmax layer kept, chosen by the
  stage-1 error (``auto:1``) or fixed (layer 0, the release's pattern);
* from the linear teacher (64 tokens): ``linear-continued``, and MHLA installed with a ``uniform`` mixing
  matrix (``eps`` / M: exactly the teacher at step 0) or the paper's locality init;
* ``--softmax-layers`` (any grid): K = 1 .. depth / 2 softmax layers chosen by the end-to-end ranking, by
  the per-layer error or by the release's fixed pattern, with each K's measured latency
  (``studies.softmax_layers``: quality against latency; K = 0 is ``mhla-stage1-all``). ``--arms`` may
  also name single sweep arms (``softmax1-e2e``, ``softmax2-fixed``, ...) without the whole sweep.

FID (digits CNN) and label accuracy at 0, 1/8, 1/4, 1/2 and all of the stage-2 budget, through
``studies.experiments`` (the study's runner: resumable, parallel). ``--scratch`` adds MHLA trained from
scratch up to each seed's conversion FLOPs (:class:`mhla_gen.metrics.flops.Conversion`: teacher + stage 1 +
stage 2), and the report reads conversion against it at equal total FLOPs and with the teacher a sunk cost
(stage 1 + stage 2 only: a user who already has the teacher). Writes OUT/record.npz (the record
every table and plot is rendered from: eval/results.py), OUT/adaptation.md, OUT/adaptation.json and
OUT/curves_<grid>.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
from studies import sibling
from studies.adaptation_arms import (
    CONFIG,
    GRIDS,
    QUICK_ARMS,
    SMOKE_ARMS,
    STAGE1_ALL,
    SWEEP_K0,
    arms,
    base_overrides,
    grid_model,
    softmax_layer_latency,
    teacher,
    teacher_config,  # noqa: F401
    with_teachers,
)
from studies.adaptation_compute import compute, equal_compute_table, plot_compute  # noqa: F401
from studies.adaptation_report import DECISIONS, PRIMARIES, decisions, end_to_end, grid_report, render  # noqa: F401
from studies.evidence import check_questions
from studies.experiments import VAL_TRIPLES, Arm, make_jobs, result_path, study_records
from studies.folders import claim_study
from studies.softmax_layers import sweep_arms
from studies.teachers import Teacher, from_studies, paired

from mhla_gen.commands.cli import expand_path, run
from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import check_apart, file_record
from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit_flops import train_flops_per_image
from mhla_gen.train.io import atomic_write_text

# the names marked F401 above are unused here: tests/test_eval_adaptation.py reads them as this script's

results = sibling("results")  # the record this study renders from


def plan(args) -> list:
    """Every job: each grid's arms x seeds, seed k's from teacher k (:mod:`studies.teachers`)."""
    jobs = []
    for name in args.grids:
        grid = dict(GRIDS[name], **({"steps": args.steps} if args.steps else {}))
        model = grid_model(grid)
        default = {"smoke": SMOKE_ARMS, "quick": QUICK_ARMS}.get(name.split("-")[-1])
        wanted = args.arms or default
        sweep = sweep_arms(model["depth"], "model.init_from=@softmax", STAGE1_ALL)
        if wanted is not None and args.softmax_layers:  # every K, and mhla-stage1-all for K = 0
            wanted = {*wanted, SWEEP_K0, *(arm.name for arm in sweep)}
        if wanted is None and not args.softmax_layers:  # the sweep only when asked or named
            sweep = []
        candidates = [*arms(name, 1e-6, np.prod(grid["blocks"])), *sweep]
        chosen = [arm for arm in candidates if wanted is None or arm.name in wanted]
        named = " ".join(item for arm in chosen for item in (*arm.overrides, *(arm.stage1 or ())))
        teachers = {a: teachers_for(args, name, a, grid, model) for a in ("softmax", "linear")
                    if f"@{a}" in named}  # only the teachers the chosen arms start from
        extra = {"grid": name, "tokens": (grid["resolution"] // model["patch_size"]) ** 2,
                 "commit": results.code_commit()}
        base, seeds = base_overrides(grid, model), list(range(args.seeds))
        recipe = grid.get("recipe", ())  # the training runs' (stage 2, from scratch), not stage 1's
        for arm in chosen:
            for seed in seeds:  # seed k from teacher k: the teacher is part of the seed unit
                own = {a: t[seed].final for a, t in teachers.items()}
                start = next((t[seed] for a, t in teachers.items() if f"@{a}" in " ".join(
                    (*arm.overrides, *(arm.stage1 or ())))), None)
                jobs += make_jobs(args.out / name, CONFIG, base,
                                  [with_teachers(arm, own, grid["stage1_steps"])], [seed],
                                  eval_steps(grid["steps"]), grid["fid_samples"],
                                  {**extra, **(start.extra() if start else {})},
                                  grid.get("val_triples", VAL_TRIPLES), recipe)
        if args.scratch:  # MHLA from scratch up to each seed's conversion compute (FLOPs)
            jobs += scratch_jobs(args, name, grid, base, extra, teachers.get("softmax"))
    return jobs


def scratch_jobs(args, name: str, grid: dict, base: list[str], extra: dict, teachers: list | None) -> list:
    """MHLA from scratch, seed k evaluated at :func:`eval_steps` of its budget and at the steps whose
    FLOPs match seed k's conversion: stage 2 alone and stage 1 + stage 2 (the teacher a sunk cost), and
    teacher k's training + those (equal total compute). Stage 1 is counted here as one training step a
    step; the tables read the measured FLOPs and show how near each match is."""
    recipe, steps, stage1 = grid.get("recipe", ()), grid["steps"], grid["stage1_steps"]
    cfg = load_config(DiTRunConfig, CONFIG, [*base, *recipe, "model.attention=mhla"])
    step_flops = train_flops_per_image(cfg)["train"] * cfg.train.global_batch_size
    arm, jobs = Arm("mhla-scratch", ("model.attention=mhla",), "scratch"), []
    for seed in range(args.seeds):
        teacher_steps = teachers[seed].flops / step_flops if teachers else grid["teacher_steps"]
        targets = [steps, steps + stage1, teacher_steps + steps, teacher_steps + steps + stage1]
        budget = math.ceil(max(targets))
        unit = max(1, budget // 64)  # every point a multiple: checkpoints every `unit` steps at most
        points = {*eval_steps(budget), *(max(unit, unit * round(t / unit)) for t in targets)}
        jobs += make_jobs(args.out / name, CONFIG, base, [arm], [seed], sorted(points), grid["fid_samples"],
                          extra, grid.get("val_triples", VAL_TRIPLES), recipe)
    return jobs


def teachers_for(args, name: str, attention: str, grid: dict, model: dict) -> list[Teacher]:
    """The ``attention`` teachers of grid ``name``, one per seed (seed k's: teacher k): from the
    ``--teachers-from`` studies (refused when they hold fewer, or a teacher of another grid or model), or
    trained under ``--out`` (seed k's with seed k)."""
    if args.teachers_from:
        expected = {"data.source": grid.get("data", "digits"), "data.resolution": grid["resolution"],
                    **{f"model.{k}": v for k, v in model.items()}, "model.attention": attention}
        found = from_studies(args.teachers_from, name, attention, expected)
        chosen = paired(found, args.seeds, "--teachers-from " + " ".join(map(str, args.teachers_from)))
        check_apart(args.out, "--out", {**{"--teachers-from" + (f" (folder {i + 1})" if i else ""): folder
                                           for i, folder in enumerate(args.teachers_from)},
                                        **{f"--teachers-from (its {attention} teacher {t.index})": t.final
                                           for t in chosen}})
        return chosen
    train_them = getattr(args, "train_teachers", True) and not args.report_only
    if train_them:
        claim_study(args.out, "adaptation")
    return [teacher(args.out, name, attention, grid, model, seed, train_them) for seed in range(args.seeds)]


def check_teachers(jobs: list) -> None:
    """A run folder of ``--out`` must have been started from the teacher its seed is paired with now:
    ``ConfigError`` when its first evaluated point names another (records of before 2026-11-28 name
    none: every seed's teacher was then teacher 0)."""
    for job in jobs:
        path = result_path(job, job.steps[0])
        if "teacher" not in job.extra or not path.is_file():
            continue
        done = json.loads(path.read_text())
        was = done.get("teacher", "teacher 0 (a run of before 2026-11-28)")
        if was != job.extra["teacher"] and not ("teacher" not in done and job.extra["teacher_index"] == 0):
            raise ConfigError(f"--out {Path(job.result_dir).parents[2]}: {job.arm} seed {job.seed} started "
                              f"from {was}, not from {job.extra['teacher']}; use another --out")


def check_arms(args) -> None:
    """``--arms`` must name arms of the chosen grids (``ConfigError`` listing them otherwise)."""
    if not args.arms:
        return
    known = {arm.name for name in args.grids for arm in arms(name, 1e-6, 4)}
    known |= {arm.name for name in args.grids for arm in sweep_arms(grid_model(GRIDS[name])["depth"], "", ())}
    bad = [name for name in args.arms if name not in known]
    if bad:
        raise ConfigError(f"--arms {' '.join(bad)}: no such arm for --grids {' '.join(args.grids)}; "
                          f"choose from {', '.join(sorted(known))}")


def eval_steps(steps: int) -> list[int]:
    return sorted({0, *(max(1, steps * k // 8) for k in (1, 2, 4, 8))})


def select_grids(args) -> list[str]:
    """The GRIDS keys of this call (--quick / --smoke also set the seeds and jobs)."""
    key = (lambda n: n if args.data == "digits" else f"{args.data}-{n}")
    if args.quick or args.smoke:
        args.seeds = args.seeds or (2 if args.quick else 1)
        args.jobs = args.jobs if args.quick else 1
        return [key("quick" if args.quick else "smoke")]
    names = args.grids or (["64", "256"] if args.data == "digits" else ["256"])
    missing = [n for n in names if key(n) not in GRIDS]
    if missing:
        raise ConfigError(f"--grids {' '.join(missing)} is not a grid of --data {args.data} "
                          f"(digits: 64 256; shapes: 256 1024)")
    return [key(n) for n in names]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=expand_path, default="runs/adaptation")
    parser.add_argument("--data", choices=["digits", "shapes"], default="digits")
    parser.add_argument("--grids", nargs="+", choices=["64", "256", "1024"], default=None,
                        help="token counts (default: 64 256 for digits, 256 for shapes)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds, seed k's runs from teacher k (default 3; --quick 2, --smoke 1)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    parser.add_argument("--steps", type=int, default=None, help="stage-2 budget (default: per grid)")
    parser.add_argument("--arms", nargs="+", default=None, help="only these arms")
    parser.add_argument("--teachers-from", type=expand_path, nargs="+", default=None,
                        help="finished eval/study.py folders: their softmax (and linear) runs are the "
                             "teachers, the folders in order and each one's seeds by number; seed k's "
                             "stage 1 and stage 2 start from the k-th")
    parser.add_argument("--report-only", action="store_true",
                        help="tables and plots from the runs finished so far; train nothing")
    parser.add_argument("--scratch", action="store_true",
                        help="also MHLA trained from scratch, each seed up to its conversion's FLOPs "
                             "(teacher + stage 1 + stage 2), read at equal total compute and with the "
                             "teacher a sunk cost")
    parser.add_argument("--softmax-layers", action="store_true",
                        help="also K = 1 .. depth/2 softmax layers chosen by the end-to-end ranking, the "
                             "per-layer error and the release's fixed pattern, against measured latency")
    parser.add_argument("--quick", action="store_true", help="CI-sized: about 10 min of 2 cores")
    parser.add_argument("--smoke", action="store_true", help="seconds: a tiny model, a few steps")
    args = parser.parse_args(argv)
    for flag, value, least in (("--seeds", args.seeds, 1), ("--jobs", args.jobs, 1),
                               ("--steps", args.steps, 8)):
        if value is not None and value < least:  # before --quick / --smoke / the default fill them in
            raise ConfigError(f"{flag} must be >= {least}, got {value}")
    args.grids = select_grids(args)
    args.seeds = args.seeds or 3
    args.out = Path(args.out)
    check_arms(args)  # before any teacher is trained
    check_questions(DECISIONS, PRIMARIES, "eval/adaptation.py")  # each names its primary metric
    command = "python eval/adaptation.py " + " ".join(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    start = time.perf_counter()
    args.train_teachers = False  # first the plan alone: refuse a --out of other teachers before training any
    check_teachers(plan(args))
    args.train_teachers = True
    jobs = plan(args)
    records = study_records(args.out, jobs, args.jobs, args.report_only, "adaptation")
    for r in records:  # records of earlier versions name the digits' FID only
        r.setdefault("fid", r.get("fid_digits"))
    latency_ms = {grid: softmax_layer_latency(grid) for grid in args.grids} if args.softmax_layers else {}
    meta = {"grids": {g: dict(GRIDS[g], **({"steps": args.steps} if args.steps else {})) for g in args.grids},
            "report_only": args.report_only, "wall_seconds": time.perf_counter() - start, "jobs": args.jobs,
            "softmax_layers": args.softmax_layers, "latency_ms": latency_ms, "configs": results.configs(jobs)}
    results.save(results.build("adaptation", command, records, args.out, meta), args.out / "record.npz")
    render(results.load(args.out / "record.npz"), args.out)  # as regenerating from the file renders it
    atomic_write_text(args.out / "adaptation.json", json.dumps(
        {"command": command, "records": records, **file_record("study")}, indent=1))
    print((args.out / "adaptation.md").read_text())
    return records


if __name__ == "__main__":
    run(main)
