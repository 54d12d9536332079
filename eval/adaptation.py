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
import os
import sys
import time
from pathlib import Path

import numpy as np
from studies import sibling
from studies.evidence import (
    NOTES,
    RULES,
    Question,
    SampleSets,
    apply_holm,
    check_questions,
    compare,
    fmt_comparison,
    footnotes,
)
from studies.evidence_stats import MIN_SEEDS
from studies.experiments import (
    SHAPES_RECIPE,
    VAL_TRIPLES,
    Arm,
    make_jobs,
    plot_arm_bands,
    result_path,
    study_records,
    summarize,
)
from studies.softmax_layers import fixed_layers, latency, sweep_arms, sweep_ks, sweep_table
from studies.teachers import Teacher, from_studies, paired, training_flops

from mhla_gen.commands.cli import expand_path, run
from mhla_gen.configs import CONFIG_DIR
from mhla_gen.errors import ConfigError
from mhla_gen.metrics.flops import Conversion
from mhla_gen.outputs.folders import check_apart, claim, file_record
from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit import DiTTask
from mhla_gen.train.dit_flops import train_flops_per_image
from mhla_gen.train.io import atomic_write_text
from mhla_gen.train.loop import train

results = sibling("results")  # the record this study renders from

CONFIG = str(CONFIG_DIR / "dit_digits.yaml")  # the main job's config (mhla_gen.configs)
MODEL = dict(hidden_size=64, depth=4, heads=4, patch_size=2)  # eval/study.py's
TINY_MODEL = dict(hidden_size=16, depth=2, heads=2, patch_size=2)
GRIDS = {  # teacher budget, stage-1 and stage-2 budgets, FID samples / sampler steps
    "64": dict(resolution=16, blocks=(2, 2), teacher_steps=1500, stage1_steps=200, steps=400, batch=32,
               fid_samples=500, sample_steps=20),
    "256": dict(resolution=32, blocks=(4, 4), teacher_steps=1200, stage1_steps=150, steps=300, batch=32,
                fid_samples=300, sample_steps=10),
    "shapes-256": dict(data="shapes", resolution=32, blocks=(4, 4), teacher_steps=2400, stage1_steps=150,
                       steps=600, batch=32, fid_samples=300, sample_steps=10, recipe=SHAPES_RECIPE),
    "shapes-1024": dict(data="shapes", resolution=64, blocks=(4, 4), teacher_steps=2400, stage1_steps=150,
                        steps=600, batch=16, fid_samples=200, sample_steps=10, recipe=SHAPES_RECIPE),
    # --quick: CI-sized (about 10 min of 2 cores)
    "quick": dict(resolution=16, blocks=(2, 2), teacher_steps=200, stage1_steps=50, steps=100, batch=32,
                  fid_samples=200, sample_steps=10),
    "shapes-quick": dict(data="shapes", resolution=32, blocks=(4, 4), teacher_steps=200, stage1_steps=40,
                         steps=80, batch=32, fid_samples=200, sample_steps=10, recipe=SHAPES_RECIPE),
    # --smoke: seconds (the tests)
    "smoke": dict(resolution=8, blocks=(2, 2), teacher_steps=4, stage1_steps=2, steps=4, batch=8,
                  fid_samples=20, sample_steps=2, tiny=True, val_triples=32),
    "shapes-smoke": dict(data="shapes", resolution=32, blocks=(2, 2), teacher_steps=4, stage1_steps=2,
                         steps=4, batch=8, fid_samples=20, sample_steps=2, tiny=True, patch=8,
                         val_triples=32, recipe=SHAPES_RECIPE),
}
# stage 1 of mhla-stage1 and the schedule arms: MHLA's own parameters (the default trains every parameter of
# the converted layers: mhla-stage1-all); ema 0: final/ and its errors are the trained weights
STAGE1 = ("model.attention=mhla", "transfer.trainable=mhla", "train.ema_decay=0")
STAGE1_ALL = (*STAGE1, "transfer.trainable=all")  # the default stage 1: every parameter of converted layers
# LoRA-style stage 2 as the LLM converters run it (LoLCATs: rank 8, alpha 16 on q/k/v/out), MHLA trained too
LORA = ("train.trainable=lora", "train.lora_rank=8", "train.lora_alpha=16")
SWEEP_K0 = "mhla-stage1-all"  # the softmax-layer sweep's K = 0: its stage 1 with no softmax layer kept


def arms(grid: str, eps: float, blocks: int) -> list[Arm]:
    """The arms of one grid (the hybrid and linear-teacher arms at 64 tokens only, see the docstring;
    the stage-2 schedules on every grid)."""
    soft, lin = "model.init_from=@softmax", "model.init_from=@linear"
    distill = ("train.distill.output_weight=1", "train.distill.attention_weight=1")
    e2e = "transfer.output_weight=1"  # stage 1's end-to-end term beside the per-layer errors
    main = [
        Arm("softmax-continued", (soft, "model.attention=softmax")),
        Arm("linear-plain", (soft, "model.attention=linear")),
        Arm("mhla-plain", (soft, "model.attention=mhla")),
        Arm("mhla-stage1", (), stage1=(soft, *STAGE1)),
        Arm("mhla-stage1-distill", distill, stage1=(soft, *STAGE1)),
        Arm("mhla-stage1-all", (), stage1=(soft, *STAGE1_ALL)),
        Arm("mhla-stage1-qk", (), stage1=(soft, *STAGE1, "transfer.trainable=mhla+qk")),
        Arm("mhla-stage1-e2e", (), stage1=(soft, *STAGE1, e2e)),
        Arm("mhla-stage1-all-e2e", (), stage1=(soft, *STAGE1_ALL, e2e)),
    ]
    schedules = [  # stage 2 from the same stage 1 as mhla-stage1 (and plain conversion without warm-up)
        Arm("mhla-plain-no-warmup", (soft, "model.attention=mhla", "train.lr_warmup_steps=0"), "schedule"),
        Arm("stage2-no-warmup", ("train.lr_warmup_steps=0",), "schedule", stage1=(soft, *STAGE1)),
        Arm("stage2-low-lr", ("train.learning_rate=3e-4",), "schedule", stage1=(soft, *STAGE1)),
        Arm("stage2-from-stage1-ema", (), "schedule", stage1=(soft, *STAGE1[:-1], "train.ema_decay=0.99")),
        Arm("stage2-output-distill", ("train.distill.output_weight=1",), "schedule", stage1=(soft, *STAGE1)),
        Arm("stage2-mhla-only", ("train.trainable=mhla",), "schedule", stage1=(soft, *STAGE1)),
        Arm("stage2-lora", LORA, "schedule", stage1=(soft, *STAGE1)),
        # LoRA is usually run at a higher peak LR than full fine-tuning
        Arm("stage2-lora-high-lr", (*LORA, "train.learning_rate=1e-2"), "schedule", stage1=(soft, *STAGE1)),
        # after the default stage 1 (every parameter; LoLCATs' order: attention transfer, then LoRA)
        Arm("stage2-lora-after-all", LORA, "schedule", stage1=(soft, *STAGE1_ALL)),
        Arm("stage2-no-warmup-after-all", ("train.lr_warmup_steps=0",), "schedule",
            stage1=(soft, *STAGE1_ALL)),
    ]
    main += schedules
    if grid.split("-")[-1] != "64" and grid not in ("smoke", "quick"):
        return main
    fresh = (lin, "model.init_attention=fresh", "model.attention=mhla")
    return main + [
        Arm("hybrid-auto", (), "hybrid", stage1=(soft, *STAGE1, "hybrid.softmax_layers=auto:1")),
        Arm("hybrid-fixed", (), "hybrid", stage1=(soft, *STAGE1, "hybrid.softmax_layers=[0]")),
        Arm("linear-continued", (lin,), "linear teacher"),
        Arm("mhla-from-linear-uniform", (*fresh, "mhla.mixing_init=uniform", f"mhla.eps={eps / blocks}"),
            "linear teacher"),
        Arm("mhla-from-linear-locality", (*fresh, "mhla.mixing_init=linear"), "linear teacher"),
    ]


def base_overrides(grid: dict, model: dict) -> list[str]:
    """The grid's data, model and batch; the schedule is the config's (configs/dit_digits.yaml: 50 warm-up
    steps, as the documented stage-2 command runs) unless an arm says otherwise. On the shapes the
    training runs (teachers, stage 2, from scratch; not stage 1, whose transfer loss has its own schedule)
    add the grid's ``recipe`` (:data:`SHAPES_RECIPE`, as the study's) before the arm's own overrides."""
    return [
        f"data.source={grid.get('data', 'digits')}", f"data.resolution={grid['resolution']}",
        f"mhla.blocks=[{grid['blocks'][0]},{grid['blocks'][1]}]",
        *(f"model.{k}={v}" for k, v in model.items()), f"train.global_batch_size={grid['batch']}",
        f"log.every={max(1, grid['steps'] // 20)}", "log.trackers=[]",
        "log.num_samples=1", f"log.sample_steps={grid['sample_steps']}",
    ]


def grid_model(grid: dict) -> dict:
    return dict(TINY_MODEL, patch_size=grid.get("patch", 2)) if grid.get("tiny") else MODEL


def teacher_config(out: Path, name: str, attention: str, grid: dict, model: dict, seed: int) -> DiTRunConfig:
    """The run config of seed ``seed``'s ``attention`` teacher of ``grid`` (its folder under ``out``: seed 0
    keeps the folder of the single teacher of before 2026-11-28)."""
    folder = out / "teachers" / (f"{name}-{attention}" + (f"-seed{seed}" if seed else ""))
    return load_config(DiTRunConfig, CONFIG, [
        *base_overrides(grid, model), f"model.attention={attention}", f"output_dir={folder}",
        f"seed={seed}", f"train.max_steps={grid['teacher_steps']}", "eval.fid_num_samples=0",
        f"train.lr_warmup_steps={min(50, grid['teacher_steps'] // 10)}", *grid.get("recipe", ()),
    ])


def teacher(out: Path, name: str, attention: str, grid: dict, model: dict, seed: int = 0,
            train_it: bool = True) -> Teacher:
    """Seed ``seed``'s ``attention`` teacher of ``grid``, trained under ``out`` unless finished (or
    ``train_it`` is false: ``--report-only``)."""
    cfg = teacher_config(out, name, attention, grid, model, seed)
    folder = Path(cfg.output_dir)
    if train_it and not (folder / "final").is_dir():
        train(cfg, DiTTask(cfg))
    return Teacher(attention, seed, str(folder.resolve()), folder / "final", cfg.train.max_steps,
                   training_flops(cfg))


SMOKE_ARMS = ("softmax-continued", "mhla-plain", "mhla-stage1-distill", "hybrid-auto",
              "mhla-from-linear-uniform")
QUICK_ARMS = ("softmax-continued", "mhla-plain", "mhla-stage1", "mhla-stage1-qk", "stage2-no-warmup")


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


def conversion(record: dict) -> Conversion | None:
    """The training FLOPs behind ``record``'s model (:class:`mhla_gen.metrics.flops.Conversion`: its teacher's
    training, stage 1 and stage 2; from scratch its own steps), or None where the record lacks them (a
    conversion arm of before 2026-11-28: no ``teacher_flops``, a stage 1 without its FLOPs)."""
    if "flops_per_image" not in record or (record["arm"] != "mhla-scratch" and "teacher_flops" not in record):
        return None
    if "stage1" in record and not math.isfinite(record["stage1"].get("flops", math.nan)):
        return None
    return Conversion.of_point(record)


def compute(record: dict, sunk_teacher: bool = False) -> float:
    """FLOPs behind ``record``'s model at its step: teacher + stage 1 + stage 2 (equal total compute), or
    with ``sunk_teacher`` stage 1 + stage 2 (a user who has the teacher); NaN where not recorded."""
    found = conversion(record)
    if found is None:
        return math.nan
    return found.after_teacher(record["step"]) if sunk_teacher else found.total(record["step"])


def with_teachers(arm: Arm, teachers: dict[str, Path], stage1_steps: int) -> Arm:
    """``arm`` with ``@softmax`` / ``@linear`` replaced by the teachers' folders (absolute: a stage-1 run is
    found by its settings, which must not depend on how ``--out`` was spelled), and the stage-1 budget."""
    def resolve(items):
        for attention, path in teachers.items():
            items = tuple(i.replace(f"@{attention}", os.path.abspath(path)) for i in items)
        return items

    stage1 = (*resolve(arm.stage1), f"train.max_steps={stage1_steps}") if arm.stage1 else None
    return Arm(arm.name, resolve(arm.overrides), arm.group, stage1)


def teachers_for(args, name: str, attention: str, grid: dict, model: dict) -> list[Teacher]:
    """The ``attention`` teachers of grid ``name``, one per seed (seed k's: teacher k): from the
    ``--teachers-from`` studies (refused when they hold fewer, or a teacher of another grid or model), or
    trained under ``--out`` (seed k's with seed k)."""
    if args.teachers_from:
        expected = {"data.source": grid.get("data", "digits"), "data.resolution": grid["resolution"],
                    **{f"model.{k}": v for k, v in model.items()}, "model.attention": attention}
        found = from_studies(args.teachers_from, name, attention, expected)
        chosen = paired(found, args.seeds, "--teachers-from " + " ".join(map(str, args.teachers_from)))
        check_apart(args.out, "--out", {f"--teachers-from (its {attention} teacher {t.index})": t.final
                                        for t in chosen})
        return chosen
    train_them = getattr(args, "train_teachers", True) and not args.report_only
    if train_them:
        claim(args.out, "study", "--out")
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


# ------------------------------------------------------------------------------------------ report
def fmt(s: dict, digits: int = 1) -> str:
    ci = "" if np.isnan(s["ci"]) else f" ± {s['ci']:.{digits}f}"
    return f"{s['mean']:.{digits}f}{ci}"


def within(stats: dict, arm: str, target: float, steps: list[int]) -> str:
    """The first evaluated step at which the arm's mean FID is within 10 % of ``target``."""
    hit = [s for s in steps if stats[(arm, s)]["mean"] <= 1.1 * target]
    return str(hit[0]) if hit else f"> {steps[-1]}"


def end_to_end(recs: list[dict], arm: str) -> str:
    """Stage 1's end-to-end output error, plain conversion → the saved model, mean over the arm's seeds."""
    by_seed = {r["seed"]: r["stage1"] for r in recs
               if r["arm"] == arm and "end_to_end_final" in r.get("stage1", {})}
    if not by_seed:
        return "—"
    before, final = (np.mean([s1[k] for s1 in by_seed.values()]) for k in ("end_to_end_before",
                                                                           "end_to_end_final"))
    return f"{before:.3f} → {final:.3f}"


def grid_report(records: list[dict], grid: str, samples: SampleSets | None = None) -> str:
    recs = [r for r in records if r["grid"] == grid]
    stats, acc = summarize(recs, "fid"), summarize(recs, "label_accuracy")
    steps = sorted({r["step"] for r in recs})
    arms_ = list(dict.fromkeys(r["arm"] for r in recs))
    target = stats[("softmax-continued", 0)]["mean"] if ("softmax-continued", 0) in stats else None
    teacher = ("the teacher's FID is not measured here (no softmax-continued arm)" if target is None
               else f"the softmax teacher's FID is {target:.1f} (softmax-continued at step 0)")
    r0, teachers = recs[0], len({r.get("teacher") for r in recs})
    lines = [f"**{r0['tokens']} tokens, {r0.get('data', 'digits')}**: FID (mean ± 95 % t-interval over the "
             f"seeds, {r0['fid_samples']} samples from the same noise and labels in every arm and seed) "
             f"along stage 2; {teacher}; {teachers} teacher{'s' if teachers > 1 else ''} (seed k's runs "
             "start from teacher k)", "",
             "| arm | seeds | " + " | ".join(f"step {s}" for s in steps) + " | label acc (end) | first step "
             "within 10 % of the teacher | stage 1: FLOPs (or teacher forwards), wall s | stage 1: "
             "end-to-end error plain → final (mean over seeds) |",
             "|---|---|" + "---|" * (len(steps) + 4)]
    for arm in arms_:
        s1 = next((r["stage1"] for r in recs if r["arm"] == arm and "stage1" in r), None)
        cost = f"{stage1_flops(s1)}, {s1['wall_seconds']:.0f}" if s1 else "—"
        cells = [fmt(stats[(arm, s)]) for s in steps]
        first = "—" if target is None else within(stats, arm, target, steps)
        lines.append(f"| {arm} | {stats[(arm, steps[-1])]['n']} | " + " | ".join(cells)
                     + f" | {fmt(acc[(arm, steps[-1])], 3)} | {first} | {cost} | {end_to_end(recs, arm)} |")
    props = properties_table(recs, steps, arms_) + "\n" if on_shapes(recs) else ""
    return ("\n".join(lines) + "\n\n" + val_table(recs, steps, arms_) + "\n" + props
            + decisions(recs, steps, samples))


def stage1_flops(summary: dict) -> str:
    """Stage 1's FLOPs (teacher forwards included) for a table cell; a report of before 2026-11-28 has
    only its cost in forwards of the teacher on one batch (in parentheses)."""
    flops = summary.get("flops", math.nan)
    return f"{flops:.3g}" if math.isfinite(flops) else f"({summary['teacher_forward_equivalents']:.0f})"


def val_table(recs: list[dict], steps: list[int], arms_: list[str]) -> str:
    stats = summarize(recs, "val_loss")
    triples = recs[0].get("val_triples")
    few = f" ({triples // 4} per timestep bucket: fewer than 256)" if triples and triples < 1024 else ""
    lines = [f"Validation loss on {triples or '—'} fixed held-out triples{few} (mean ± 95 % t-interval):",
             "", "| arm | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for arm in arms_:
        lines.append(f"| {arm} | " + " | ".join(fmt(stats[(arm, s)], 4) for s in steps) + " |")
    return "\n".join(lines) + "\n"


PROPERTIES = (  # the shapes' exact scores (mhla_gen.metrics.shapes): (metric, header, digits)
    ("all_correct", "all 4 properties ↑", 3), ("count_accuracy", "count ↑", 3),
    ("colour_accuracy", "colour ↑", 3), ("shape_accuracy", "shape ↑", 3),
    ("symmetric_rate", "symmetric ↑", 3), ("symmetry_error", "symmetry error ↓", 3),
)


def properties_table(recs: list[dict], steps: list[int], arms_: list[str]) -> str:
    """On the shapes: each arm's exact property scores at a quarter of stage 2 and at its end (mean ±
    95 % t-interval), the numbers the FID's noise cannot hide."""
    quarter, last = quarter_step(steps), steps[-1]
    stats = {m: summarize(recs, m) for m, _, _ in PROPERTIES}
    heads = [f"{h} at {s}" for s in (quarter, last) for _, h, _ in PROPERTIES]
    lines = ["Exact property scores on the same samples (mean ± 95 % t-interval):", "",
             "| arm | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for arm in arms_:
        cells = [fmt(stats[m][(arm, s)], d) if (arm, s) in stats[m] else "—"
                 for s in (quarter, last) for m, _, d in PROPERTIES]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    old = "" if all("shapes_scorer" in r for r in recs) else f"\n{NOTES['old scorer']} (every column)\n"
    return "\n".join(lines) + "\n" + old


def on_shapes(recs: list[dict]) -> bool:
    """Whether ``recs`` (one grid's records) score the shapes, which carry the exact properties."""
    return recs[0].get("data") == "shapes"


def quarter_step(steps: list[int]) -> int:
    """The evaluated step nearest a quarter of the stage-2 budget (``steps[-1]``)."""
    return min(steps, key=lambda s: abs(s - max(1, steps[-1] // 4)))


# Each question's primary metric and the step it is read at, declared before a run (chosen 2026-11-28, after
# the runs in docs/results/ before then, which read every column alike): the validation loss (the denoiser's
# own objective on held-out triples, the least noisy score), at a quarter of stage 2 for the head-start
# questions and at its end for the rest. The other columns of a row are secondaries under Holm's rule.
DECISIONS = [
    Question("stage 1's head start", "mhla-stage1", "mhla-plain", "val_loss", "quarter"),
    Question("stage 1 on q/k too", "mhla-stage1-qk", "mhla-stage1", "val_loss", "quarter"),
    Question("stage 1 on every parameter", "mhla-stage1-all", "mhla-stage1", "val_loss", "quarter"),
    Question("stage 1 with the end-to-end term", "mhla-stage1-e2e", "mhla-stage1", "val_loss", "quarter"),
    Question("the end-to-end term, every parameter", "mhla-stage1-all-e2e", "mhla-stage1-all", "val_loss",
             "quarter"),
    Question("head start, every parameter", "mhla-stage1-all", "mhla-plain", "val_loss", "quarter"),
    Question("head start, every parameter + end-to-end", "mhla-stage1-all-e2e", "mhla-plain", "val_loss",
             "quarter"),
    Question("distillation in stage 2", "mhla-stage1-distill", "mhla-stage1", "val_loss"),
    Question("MHLA vs linear conversion", "mhla-plain", "linear-plain", "val_loss"),
    Question("stage 2 without warm-up", "stage2-no-warmup", "mhla-stage1", "val_loss"),
    Question("plain conversion without warm-up", "mhla-plain-no-warmup", "mhla-plain", "val_loss"),
    Question("stage 2 at a lower peak LR", "stage2-low-lr", "mhla-stage1", "val_loss"),
    Question("stage 2 from the stage-1 EMA", "stage2-from-stage1-ema", "mhla-stage1", "val_loss"),
    Question("stage 2 with output distillation only", "stage2-output-distill", "mhla-stage1", "val_loss"),
    Question("stage 2 training MHLA only", "stage2-mhla-only", "mhla-stage1", "val_loss"),
    Question("LoRA-style stage 2", "stage2-lora", "mhla-stage1", "val_loss"),
    Question("LoRA-style stage 2 at a higher peak LR", "stage2-lora-high-lr", "mhla-stage1", "val_loss"),
    Question("LoRA-style stage 2 after stage 1 on every parameter", "stage2-lora-after-all",
             "mhla-stage1-all", "val_loss"),
    Question("no warm-up after stage 1 on every parameter", "stage2-no-warmup-after-all",
             "mhla-stage1-all", "val_loss"),
]
PRIMARIES = ("fid", "val_loss")  # metrics a question may name: the decision table reads both at both steps


def decision_columns(recs: list[dict], steps: list[int]) -> list[tuple[str, int, int, str]]:
    """``(metric, step, digits, header)`` per column of the decision table: FID and validation loss at a
    quarter of stage 2 and at its end, the mid-noise bucket b2 at the end (the total is dominated by the
    least noisy bucket; b2 sees the layout); on the shapes the properties at the end."""
    quarter, last = quarter_step(steps), steps[-1]
    columns = [("fid", quarter, 1, f"FID at step {quarter}"), ("fid", last, 1, f"FID at step {last}"),
               ("val_loss", quarter, 4, f"val loss at step {quarter}"),
               ("val_loss", last, 4, f"val loss at step {last}"),
               ("val_loss_b2", last, 5, f"mid-noise val loss (b2) at step {last}")]
    if on_shapes(recs):
        columns += [("all_correct", last, 3, f"all 4 properties ↑ at step {last}"),
                    ("count_accuracy", last, 3, f"count ↑ at step {last}"),
                    ("symmetric_rate", last, 3, f"symmetric ↑ at step {last}")]
    return columns


def decisions(recs: list[dict], steps: list[int], samples: SampleSets | None = None) -> str:
    """Each question (:data:`DECISIONS`) as a paired comparison (same seed, data order and sample noise):
    its primary metric (marked) and the secondaries (Holm-adjusted) of :func:`decision_columns`, each an
    interval over seeds and the shared samples resampled jointly (per-sample scores from ``samples``;
    without them a bound, marked), its verdict and minimum detectable difference (MDD)."""
    quarter, last = quarter_step(steps), steps[-1]
    arms_ = {r["arm"] for r in recs}
    columns = decision_columns(recs, steps)
    lines = ["Paired comparisons (first minus second; lower is better for FID and validation loss, higher "
             f"for the properties; {RULES}; {TEACHER_RULE}):", "",
             "| question | comparison | seeds | " + " | ".join(c[3] for c in columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    every = []
    for q in DECISIONS:
        if q.arm in arms_ and q.other in arms_:
            at = {"quarter": quarter, "end": last}[q.step]
            primary = next(i for i, c in enumerate(columns) if c[:2] == (q.primary, at))
            cells = apply_holm([compare(recs, q.arm, q.other, metric, step, samples)
                                for metric, step, _, _ in columns], primary)
            for c, (_, step, _, _) in zip(cells, columns):
                teacher_rule([c], recs, q.arm, step)
            every += cells
            text = [fmt_comparison(c, column[2]) for c, column in zip(cells, columns)]
            lines.append(f"| {q.name} | {q.arm} − {q.other} | {cells[0]['n']} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n" + footnotes(every) + "\n"


def plot_curves(records: list[dict], grid: str, path: Path) -> None:
    """FID and validation loss along stage 2 per arm: mean over seeds, band = 95 % t-interval (min–max
    with one seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if r["grid"] == grid]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("fid", "val_loss")):
        stats = summarize(recs, metric)
        plot_arm_bands(ax, stats, recs, alpha=0.12)
        if ("softmax-continued", 0) in stats:
            ax.axhline(stats[("softmax-continued", 0)]["mean"], color="gray", linestyle=":", label="teacher")
        ax.set(xlabel="stage-2 step", ylabel=metric, yscale="log")
    axes[0].set_title(f"{recs[0]['tokens']} tokens, {recs[0].get('data', 'digits')}: mean, band = 95 % CI",
                      fontsize=9)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    results.save_figure(fig, path)


def softmax_layer_latency(grid: str) -> dict[int, float]:
    """Each K's inference milliseconds per image (K = 0 .. depth / 2), timed here side by side on models of
    the grid's size (K softmax layers from the release's pattern: only K matters); for the K sweep's
    table (:func:`studies.softmax_layers.sweep_table`)."""
    config, model = dict(GRIDS[grid]), grid_model(GRIDS[grid])
    depth = model["depth"]

    def build(k):
        kept = set(fixed_layers(k, depth))
        layers = f"[{','.join(str(i) for i in range(depth) if i not in kept)}]"
        cfg = load_config(DiTRunConfig, CONFIG, [*base_overrides(config, model), "model.attention=mhla",
                                                 f"mhla.layers={layers}"])
        return DiTTask(cfg).build_transformer()

    return latency(build, [0, *sweep_ks(depth)], config["resolution"], max(2, 8192 // (
        (config["resolution"] // model["patch_size"]) ** 2)))


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


def conversion_arms(records: list[dict]) -> list[str]:
    """Every arm of ``records`` but the from-scratch one, in the records' order: whatever ``--arms`` ran."""
    return [arm for arm in dict.fromkeys(r["arm"] for r in records) if arm != "mhla-scratch"]


READINGS = {False: "equal total compute (teacher + stage 1 + stage 2 FLOPs)",
            True: "equal compute with the teacher a sunk cost (stage 1 + stage 2 FLOPs)"}
TEACHER_RULE = (f"too few teachers = under {MIN_SEEDS} distinct teachers among the paired seeds (the "
                "teacher is part of the seed unit: seed k starts from teacher k; records of before "
                "2026-11-28 name none, one teacher)")


def plot_compute(records: list[dict], grid: str, path: Path) -> str:
    """FID against training FLOPs (:func:`compute`) for the from-scratch arm and the conversion arms, both
    readings side by side (teacher + stage 1 + stage 2; the teacher sunk), mean over seeds (of the FLOPs
    too: teachers of several budgets) with a 95 % band; returns a markdown line pointing at the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if r["grid"] == grid]
    stats = summarize(recs, "fid")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, sunk in zip(axes, (False, True)):
        for arm in ["mhla-scratch", *conversion_arms(recs)]:
            steps = sorted(s for a, s in stats if a == arm)
            x = np.array([np.mean([compute(r, sunk) for r in recs if r["arm"] == arm and r["step"] == s])
                          for s in steps])
            if not steps or not np.isfinite(x).all():
                continue  # FLOPs not recorded (before 2026-11-28)
            mean = np.array([stats[(arm, s)]["mean"] for s in steps])
            half = np.nan_to_num(np.array([stats[(arm, s)]["ci"] for s in steps]))
            ax.plot(x, mean, marker="o", label=arm)
            ax.fill_between(x, mean - half, mean + half, alpha=0.12)
        ax.set(xlabel="training FLOPs", ylabel="FID", xscale="log", yscale="log",
               title=f"{recs[0]['tokens']} tokens: {READINGS[sunk].split(' (')[0]}")
        ax.title.set_fontsize(9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    results.save_figure(fig, path)
    return f"Quality against training FLOPs, both readings: [{path.name}]({path.name})\n"


def scratch_match(recs: list[dict], record: dict, sunk: bool) -> dict | None:
    """The from-scratch point of ``record``'s seed whose FLOPs are nearest ``record``'s (:func:`compute`),
    relabelled to ``record``'s step (``result_step``: the step its files keep) with ``flops_ratio`` (its
    FLOPs / the conversion's); None where either side has no FLOPs."""
    target = compute(record, sunk)
    own = [r for r in recs if r["arm"] == "mhla-scratch" and r["seed"] == record["seed"]
           and math.isfinite(compute(r))]
    if not math.isfinite(target) or not own:
        return None
    best = min(own, key=lambda r: abs(compute(r) - target))
    return dict(best, step=record["step"], result_step=best["step"], flops_ratio=compute(best) / target)


def teacher_rule(cells: list[dict], recs: list[dict], arm: str, step: int) -> list[dict]:
    """``cells`` (comparisons of ``arm`` at ``step``) with the verdict "too few teachers" where ``arm``'s
    paired seeds start from fewer than :data:`MIN_SEEDS` distinct teachers (:data:`TEACHER_RULE`)."""
    for c in cells:
        teachers = {r.get("teacher") for r in recs
                    if r["arm"] == arm and r["step"] == step and r["seed"] in c["per_seed"]}
        if c["n"] >= MIN_SEEDS and len(teachers) < MIN_SEEDS:
            c["verdict"] = "too few teachers"
    return cells


def equal_compute_table(records: list[dict], grid: str, samples: SampleSets | None = None,
                        sunk: bool = False) -> str:
    """Each conversion arm at the end of stage 2 against MHLA from scratch at the same training FLOPs
    (:data:`READINGS`: with the teacher's, or the teacher a sunk cost), paired by seed (seed k's
    conversion from teacher k against from-scratch seed k's point nearest its FLOPs, :func:`scratch_match`;
    the same sample noise and labels): the validation loss (primary) and the FID (secondary), with
    verdicts under the seed and teacher rules."""
    recs = [r for r in records if r["grid"] == grid]
    last = max(r["step"] for r in recs if r["arm"] != "mhla-scratch")
    lines = [f"Conversion vs MHLA from scratch at {READINGS[sunk]}: each arm at the end of stage 2 (step "
             f"{last}) against the from-scratch point of its seed nearest its FLOPs (paired by seed, first "
             f"minus second, lower is better; {RULES}; {TEACHER_RULE}):", "",
             "| comparison | seeds | teachers | conversion FLOPs (mean) | from-scratch steps (FLOPs / "
             "conversion's) | val loss | FID |", "|---|---|---|---|---|---|---|"]
    every = []
    for arm in conversion_arms(recs):
        ends = [r for r in recs if r["arm"] == arm and r["step"] == last]
        matched = [m for r in ends if (m := scratch_match(recs, r, sunk)) is not None]
        if not matched:
            lines.append(f"| {arm} − mhla-scratch | — | — | not recorded (before 2026-11-28) | — | — | — |")
            continue
        cells = apply_holm([compare(ends + matched, arm, "mhla-scratch", m, last, samples)
                            for m in ("val_loss", "fid")], primary=0)
        val, fid = teacher_rule(cells, ends, arm, last)
        every += [val, fid]
        flops = np.mean([compute(r, sunk) for r in ends if r["seed"] in {m["seed"] for m in matched}])
        teachers = len({r.get("teacher") for r in ends})
        steps = sorted(m["result_step"] for m in matched)
        ratios = sorted(m["flops_ratio"] for m in matched)
        lines.append(f"| {arm} − mhla-scratch | {val['n']} | {teachers} | {flops:.3g} | "
                     f"{steps[0]}–{steps[-1]} ({ratios[0]:.2f}–{ratios[-1]:.2f}) | "
                     f"{fmt_comparison(val, 4)} | {fmt_comparison(fid, 1)} |")
    return "\n".join(lines) + "\n" + footnotes(every) + "\n"


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
    args.grids = select_grids(args)
    args.seeds = args.seeds or 3
    if args.seeds < 1 or args.jobs < 1 or (args.steps is not None and args.steps < 8):
        raise ConfigError("--seeds and --jobs must be >= 1, --steps >= 8")
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
    records = study_records(args.out, jobs, args.jobs, args.report_only)
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


def render(record, folder: Path) -> list[Path]:
    """``adaptation.md`` and the plots of an adaptation study's record (:mod:`eval/results.py`) in
    ``folder``, from the record alone; returns the files written."""
    meta, points, samples = record.meta, record.points, record.samples()
    core_hours = sum(r.get("segment_seconds", 0) for r in points) / 3600
    how = results.how_it_ran(meta)
    text = [f"# Adaptation study\n\n`{meta['command']}` — {meta['date']}, {how}, torch {meta['torch']}; "
            f"stage 2 and its evaluations summed over all runs: {core_hours:.1f} core-hours\n",
            results.commits_line(points) + "\n"]
    files = [folder / "adaptation.md"]
    for grid, settings in meta["grids"].items():
        stage2 = [r for r in points if r["grid"] == grid and r["arm"] != "mhla-scratch"]
        text.append(grid_report(stage2, grid, samples))
        plot_curves(stage2, grid, folder / f"curves_{grid}.png")
        files.append(folder / f"curves_{grid}.png")
        if meta["softmax_layers"]:
            ms = {int(k): v for k, v in meta["latency_ms"][grid].items()}  # JSON keys are strings
            depth = grid_model(settings)["depth"]
            text.append(sweep_table([r for r in points if r["grid"] == grid], ms, depth, SWEEP_K0, samples))
        if any(r["arm"] == "mhla-scratch" for r in points if r["grid"] == grid):
            text.append(plot_compute(points, grid, folder / f"compute_{grid}.png"))
            files.append(folder / f"compute_{grid}.png")
            text += [equal_compute_table(points, grid, samples, sunk) for sunk in (False, True)]
    atomic_write_text(folder / "adaptation.md", "\n".join(text))
    return files


if __name__ == "__main__":
    run(main)
