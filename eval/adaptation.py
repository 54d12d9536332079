"""How fast a converted model recovers: a pretrained softmax (or linear-attention) DiT converted to MHLA in
different ways, each arm with the same stage-2 budget and data, on the embedded digits.

    python eval/adaptation.py                               # both grids, 3 seeds (teachers trained first)
    python eval/adaptation.py --teachers-from runs/study    # the study's seed-0 softmax / linear runs
    python eval/adaptation.py --data shapes                 # the drawn shapes at 256 tokens
    python eval/adaptation.py --quick                       # CI-sized: about 10 min of 2 cores
    python eval/adaptation.py --smoke                       # seconds: a smoke test

Teachers: DiTs of the study's size (eval/study.py) trained on the digits with softmax and with linear
attention (cached under OUT/teachers by their settings, or taken from a finished study; only those the
chosen arms start from). Arms (stage 2 =
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
``studies.experiments`` (the study's runner: resumable, parallel). Writes OUT/record.npz (the record
every table and plot is rendered from: eval/results.py), OUT/adaptation.md, OUT/adaptation.json and
OUT/curves_<grid>.png.
"""

from __future__ import annotations

import argparse
import json
import logging
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
from studies.experiments import (
    SHAPES_RECIPE,
    VAL_TRIPLES,
    Arm,
    make_jobs,
    plot_arm_bands,
    study_records,
    summarize,
)
from studies.softmax_layers import fixed_layers, latency, sweep_arms, sweep_ks, sweep_table

from mhla_gen.commands.cli import expand_path, run
from mhla_gen.configs import CONFIG_DIR
from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import check_apart, claim, file_record
from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit import DiTTask
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


def teacher(out: Path, name: str, attention: str, grid: dict, model: dict, seed: int = 0) -> Path:
    """The ``attention`` teacher of ``grid`` (trained once under ``out``; reused when finished)."""
    folder = out / "teachers" / f"{name}-{attention}"
    if not (folder / "final").is_dir():
        cfg = load_config(DiTRunConfig, CONFIG, [
            *base_overrides(grid, model), f"model.attention={attention}", f"output_dir={folder}",
            f"seed={seed}", f"train.max_steps={grid['teacher_steps']}", "eval.fid_num_samples=0",
            f"train.lr_warmup_steps={min(50, grid['teacher_steps'] // 10)}", *grid.get("recipe", ()),
        ])
        train(cfg, DiTTask(cfg))
    return folder / "final"


SMOKE_ARMS = ("softmax-continued", "mhla-plain", "mhla-stage1-distill", "hybrid-auto",
              "mhla-from-linear-uniform")
QUICK_ARMS = ("softmax-continued", "mhla-plain", "mhla-stage1", "mhla-stage1-qk", "stage2-no-warmup")


def plan(args) -> list:
    """Every job: each grid's arms x seeds, with the teachers' folders filled in."""
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
        teachers = {a: teacher_path(args, name, a, grid, model) for a in ("softmax", "linear")
                    if f"@{a}" in named}  # only the teachers the chosen arms start from
        chosen = [with_teachers(arm, teachers, grid["stage1_steps"]) for arm in chosen]
        extra = {"grid": name, "tokens": (grid["resolution"] // model["patch_size"]) ** 2,
                 "commit": results.code_commit()}
        base, seeds = base_overrides(grid, model), list(range(args.seeds))
        recipe = grid.get("recipe", ())  # the training runs' (stage 2, from scratch), not stage 1's
        jobs += make_jobs(args.out / name, CONFIG, base, chosen, seeds, eval_steps(grid["steps"]),
                          grid["fid_samples"], extra, grid.get("val_triples", VAL_TRIPLES), recipe)
        if args.scratch:  # MHLA from scratch for the teacher's budget plus stage 2's: equal training steps
            scratch = [Arm("mhla-scratch", ("model.attention=mhla",), "scratch")]
            budget = grid["teacher_steps"] + grid["steps"]
            jobs += make_jobs(args.out / name, CONFIG, base, scratch, seeds, eval_steps(budget),
                              grid["fid_samples"], {**extra, "teacher_steps": grid["teacher_steps"]},
                              grid.get("val_triples", VAL_TRIPLES), recipe)
    return jobs


def compute(record: dict, teacher_steps: int) -> float:
    """Training compute up to ``record`` in forwards of the model on one batch (teacher-forward
    equivalents; a training step is about 3: forward and backward): the teacher's training, stage 1
    (its measured cost) and stage 2 for a conversion arm; the steps alone for the from-scratch arm."""
    if record["arm"] == "mhla-scratch":
        return 3.0 * record["step"]
    stage1 = record.get("stage1", {}).get("teacher_forward_equivalents", 0.0)
    return 3.0 * teacher_steps + stage1 + 3.0 * record["step"]


def with_teachers(arm: Arm, teachers: dict[str, Path], stage1_steps: int) -> Arm:
    """``arm`` with ``@softmax`` / ``@linear`` replaced by the teachers' folders (absolute: a stage-1 run is
    found by its settings, which must not depend on how ``--out`` was spelled), and the stage-1 budget."""
    def resolve(items):
        for attention, path in teachers.items():
            items = tuple(i.replace(f"@{attention}", os.path.abspath(path)) for i in items)
        return items

    stage1 = (*resolve(arm.stage1), f"train.max_steps={stage1_steps}") if arm.stage1 else None
    return Arm(arm.name, resolve(arm.overrides), arm.group, stage1)


def teacher_path(args, name: str, attention: str, grid: dict, model: dict) -> Path:
    if args.teachers_from is not None:
        path = Path(args.teachers_from) / name / "runs" / attention / "seed0" / "final"
        if not path.is_dir():
            raise ConfigError(f"--teachers-from {args.teachers_from}: no {path} (run eval/study.py first)")
        check_apart(args.out, "--out", {f"--teachers-from (its {attention} teacher)": path})
        return path
    if args.report_only:  # the folder the teacher was (or would be) trained in
        return Path(args.out) / "teachers" / f"{name}-{attention}" / "final"
    claim(args.out, "study", "--out")
    return teacher(args.out, name, attention, grid, model)


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
    r0 = recs[0]
    lines = [f"**{r0['tokens']} tokens, {r0.get('data', 'digits')}**: FID (mean ± 95 % t-interval over the "
             f"seeds, {r0['fid_samples']} samples from the same noise and labels in every arm and seed) "
             f"along stage 2; {teacher}", "",
             "| arm | seeds | " + " | ".join(f"step {s}" for s in steps) + " | label acc (end) | first step "
             "within 10 % of the teacher | stage 1: teacher-forward equivalents, wall s | stage 1: "
             "end-to-end error plain → final (mean over seeds) |",
             "|---|---|" + "---|" * (len(steps) + 4)]
    for arm in arms_:
        s1 = next((r["stage1"] for r in recs if r["arm"] == arm and "stage1" in r), None)
        cost = f"{s1['teacher_forward_equivalents']:.0f}, {s1['wall_seconds']:.0f}" if s1 else "—"
        cells = [fmt(stats[(arm, s)]) for s in steps]
        first = "—" if target is None else within(stats, arm, target, steps)
        lines.append(f"| {arm} | {stats[(arm, steps[-1])]['n']} | " + " | ".join(cells)
                     + f" | {fmt(acc[(arm, steps[-1])], 3)} | {first} | {cost} | {end_to_end(recs, arm)} |")
    props = properties_table(recs, steps, arms_) + "\n" if on_shapes(recs) else ""
    return ("\n".join(lines) + "\n\n" + val_table(recs, steps, arms_) + "\n" + props
            + decisions(recs, steps, samples))


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
             f"for the properties; {RULES}):", "",
             "| question | comparison | seeds | " + " | ".join(c[3] for c in columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    every = []
    for q in DECISIONS:
        if q.arm in arms_ and q.other in arms_:
            at = {"quarter": quarter, "end": last}[q.step]
            primary = next(i for i, c in enumerate(columns) if c[:2] == (q.primary, at))
            cells = apply_holm([compare(recs, q.arm, q.other, metric, step, samples)
                                for metric, step, _, _ in columns], primary)
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
        args.seeds = min(args.seeds, 2 if args.quick else 1)
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


def plot_compute(records: list[dict], grid: str, teacher_steps: int, path: Path) -> str:
    """FID against total training compute (:func:`compute`) for the from-scratch arm and the conversion
    arms, mean over seeds with a 95 % band; returns a markdown paragraph pointing at the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if r["grid"] == grid]
    stats = summarize(recs, "fid")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm in ["mhla-scratch", *conversion_arms(recs)]:
        steps = sorted(s for a, s in stats if a == arm)
        if not steps:
            continue
        first = {s: next(r for r in recs if r["arm"] == arm and r["step"] == s) for s in steps}
        x = [compute(first[s], teacher_steps) for s in steps]
        mean = np.array([stats[(arm, s)]["mean"] for s in steps])
        half = np.nan_to_num(np.array([stats[(arm, s)]["ci"] for s in steps]))
        ax.plot(x, mean, marker="o", label=arm)
        ax.fill_between(x, mean - half, mean + half, alpha=0.12)
    ax.set(xlabel="training compute (forwards of one batch; teacher + stage 1 + stage 2)", ylabel="FID",
           yscale="log", title=f"{recs[0]['tokens']} tokens: convert vs from scratch at equal compute")
    ax.legend(fontsize=7)
    fig.tight_layout()
    results.save_figure(fig, path)
    return (f"Quality against compute (conversion arms start after the teacher's {teacher_steps} steps): "
            f"[{path.name}]({path.name})\n")


def equal_compute_table(records: list[dict], grid: str, teacher_steps: int,
                        samples: SampleSets | None = None) -> str:
    """Each conversion arm at the end of stage 2 against MHLA from scratch after the same number of
    training steps (the teacher's plus stage 2's), paired by seed (the same sample noise and labels;
    stage 1 adds its measured cost, reported beside it): the validation loss (primary) and the FID
    (secondary), with verdicts."""
    recs = [r for r in records if r["grid"] == grid]
    last = max(r["step"] for r in recs if r["arm"] != "mhla-scratch")
    # the from-scratch records re-labelled by the stage-2 step at equal training steps (their files keep
    # the step they were evaluated at: result_step)
    shifted = [dict(r, step=r["step"] - teacher_steps, result_step=r["step"])
               for r in recs if r["arm"] == "mhla-scratch"]
    pool = [r for r in recs if r["arm"] != "mhla-scratch"] + shifted
    lines = [f"Conversion vs MHLA from scratch at equal training steps ({teacher_steps} + {last}; paired by "
             f"seed, first minus second, lower is better; {RULES}):", "",
             "| comparison | seeds | stage-1 cost (forwards of one batch) | val loss | FID |",
             "|---|---|---|---|---|"]
    every = []
    for arm in conversion_arms(recs):
        val, fid = apply_holm([compare(pool, arm, "mhla-scratch", m, last, samples)
                               for m in ("val_loss", "fid")], primary=0)
        every += [val, fid]
        if fid["n"]:
            stage1 = next(r for r in pool if r["arm"] == arm).get("stage1", {})
            cost = f"{stage1['teacher_forward_equivalents']:.0f}" if stage1 else "0"
            total = compute({"arm": "mhla-scratch", "step": teacher_steps + last}, teacher_steps)
            lines.append(f"| {arm} − mhla-scratch | {fid['n']} | {cost} of {total:.0f} | "
                         f"{fmt_comparison(val, 4)} | {fmt_comparison(fid, 1)} |")
    return "\n".join(lines) + "\n" + footnotes(every) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=expand_path, default="runs/adaptation")
    parser.add_argument("--data", choices=["digits", "shapes"], default="digits")
    parser.add_argument("--grids", nargs="+", choices=["64", "256", "1024"], default=None,
                        help="token counts (default: 64 256 for digits, 256 for shapes)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    parser.add_argument("--steps", type=int, default=None, help="stage-2 budget (default: per grid)")
    parser.add_argument("--arms", nargs="+", default=None, help="only these arms")
    parser.add_argument("--teachers-from", type=expand_path, default=None,
                        help="a finished eval/study.py folder: its seed-0 softmax and linear runs")
    parser.add_argument("--report-only", action="store_true",
                        help="tables and plots from the runs finished so far; train nothing")
    parser.add_argument("--scratch", action="store_true",
                        help="also MHLA trained from scratch for the teacher's plus stage 2's steps (equal "
                             "compute: the curve of quality against teacher-forward equivalents)")
    parser.add_argument("--softmax-layers", action="store_true",
                        help="also K = 1 .. depth/2 softmax layers chosen by the end-to-end ranking, the "
                             "per-layer error and the release's fixed pattern, against measured latency")
    parser.add_argument("--quick", action="store_true", help="CI-sized: about 10 min of 2 cores")
    parser.add_argument("--smoke", action="store_true", help="seconds: a tiny model, a few steps")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1 or (args.steps is not None and args.steps < 8):
        raise ConfigError("--seeds and --jobs must be >= 1, --steps >= 8")
    args.grids = select_grids(args)
    args.out = Path(args.out)
    check_arms(args)  # before any teacher is trained
    check_questions(DECISIONS, PRIMARIES, "eval/adaptation.py")  # each names its primary metric
    command = "python eval/adaptation.py " + " ".join(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    start = time.perf_counter()
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
            text.append(plot_compute(points, grid, settings["teacher_steps"], folder / f"compute_{grid}.png"))
            files.append(folder / f"compute_{grid}.png")
            text.append(equal_compute_table(points, grid, settings["teacher_steps"], samples))
    atomic_write_text(folder / "adaptation.md", "\n".join(text))
    return files


if __name__ == "__main__":
    run(main)
