"""Softmax vs linear vs MHLA attention on the embedded digits, with seeds, two grid sizes, learning
curves and the paper's MHLA ablations; tables and plots for the README.

    python eval/study.py                              # both grids, 3 seeds, ablations (see --help)
    python eval/study.py --grids 256 --seeds 5 --jobs 2
    python eval/study.py --data shapes --grids 256    # the drawn shapes (content at 256 / 1024 tokens)
    python eval/study.py --quick                      # CI-sized: about 10 min of 2 cores
    python eval/study.py --smoke                      # seconds: a smoke test of the whole pipeline

Every arm is one DiT of the same size trained with the same data, budget and seeds by
``mhla_gen.train.loop.train`` (configs/dit_digits.yaml + the overrides below); only the attention (or
one MHLA setting, for the ablations) differs. "linear" is MHLA with one block: global ReLU linear
attention, as SANA's. Grids:

* ``64``: 16x16 px digits, patch 2 -> an 8x8 token grid, MHLA blocks 2x2 (4 blocks of 16 tokens);
* ``256``: 32x32 px digits, patch 2 -> a 16x16 token grid, MHLA blocks 4x4 (16 blocks of 16 tokens,
  the paper's DiT-S/2 setting).

Each (arm, seed) is evaluated at 1/4, 1/2 and all of the budget (FID of samples drawn from the same
noise and labels in every arm and seed, with its bootstrap spread; label accuracy; the shapes' exact
properties; the validation loss on fixed held-out triples; training loss; attention rank / entropy;
studies.evidence), through ``studies.experiments`` (the
runner shared with eval/adaptation.py: resumable, parallel). Ablations (256 tokens, against plain MHLA
with the same seeds): uniform vs locality mixing init, fixed vs learnable mixing (paper Tab. 7a), CPE
and the output gate (App. F.2). Throughput of the three attentions is timed separately, side by side in
one process, at 64, 256 and 1024 tokens.

Writes OUT/record.npz (the record every table and plot is rendered from: eval/results.py), OUT/study.md
(tables), OUT/study.json (every point), OUT/curves_<grid>.png and OUT/samples_<grid>.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch
from studies import sibling
from studies.evidence import (
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

from mhla_gen.commands.cli import expand_path, run
from mhla_gen.configs import CONFIG_DIR
from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import file_record
from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit import DiTTask
from mhla_gen.train.io import atomic_write_text

results = sibling("results")  # the record this study renders from

CONFIG = str(CONFIG_DIR / "dit_digits.yaml")  # the main job's config (mhla_gen.configs)

MODEL = dict(hidden_size=64, depth=4, heads=4, patch_size=2)
GRIDS = {  # grid -> data and budget (the digits: about an hour of 2 CPU cores per grid, see README)
    "64": dict(resolution=16, blocks=(2, 2), steps=1500, batch=32, fid_samples=1000, sample_steps=20),
    "256": dict(resolution=32, blocks=(4, 4), steps=1200, batch=32, fid_samples=500, sample_steps=10),
    # shapes at 256 tokens: 4800 steps, since MHLA with 4x4 blocks draws the mirror symmetry only after
    # 2400 (symmetric 0 at 2400, 0.17-0.29 at 4800 in 3 seeds: docs/results/mhla_vs_softmax.md, 2026-11-27)
    "shapes-256": dict(data="shapes", resolution=32, blocks=(4, 4), steps=4800, batch=32, fid_samples=500,
                       sample_steps=10, recipe=SHAPES_RECIPE),
    "shapes-1024": dict(data="shapes", resolution=64, blocks=(4, 4), steps=2400, batch=16, fid_samples=300,
                        sample_steps=10, recipe=SHAPES_RECIPE),
    # --quick: CI-sized (about 10 min of 2 cores): the main arms, 2 seeds, no ablations
    "quick": dict(resolution=16, blocks=(2, 2), steps=300, batch=32, fid_samples=300, sample_steps=10),
    "shapes-quick": dict(data="shapes", resolution=32, blocks=(4, 4), steps=200, batch=32, fid_samples=200,
                         sample_steps=10, recipe=SHAPES_RECIPE),
    # --smoke: seconds, a tiny model (the tests)
    "smoke": dict(resolution=8, blocks=(2, 2), steps=4, batch=8, fid_samples=20, sample_steps=2, tiny=True,
                  val_triples=32),
    "shapes-smoke": dict(data="shapes", resolution=32, blocks=(2, 2), steps=4, batch=8, fid_samples=20,
                         sample_steps=2, tiny=True, patch=8, val_triples=32, recipe=SHAPES_RECIPE),
}
TINY_MODEL = dict(hidden_size=16, depth=1, heads=2, patch_size=2)
MAIN_ARMS = [Arm("softmax", ("model.attention=softmax",)), Arm("linear", ("model.attention=linear",)),
             Arm("mhla", ("model.attention=mhla",))]
ABLATIONS = [  # each against plain MHLA, same seeds
    Arm("mhla-uniform-init", ("model.attention=mhla", "mhla.mixing_init=uniform"), "ablation"),
    Arm("mhla-fixed-mixing", ("model.attention=mhla", "mhla.mixing_learnable=false"), "ablation"),
    Arm("mhla+cpe", ("model.attention=mhla", "mhla.cpe_kernel=3"), "ablation"),
    Arm("mhla+gate", ("model.attention=mhla", "mhla.gate=true"), "ablation"),
]
# MHLA keeping one softmax layer, layer L (layer 0 is the release's pattern; mhla.layers is filled in per
# model depth): run only when named (--ablations mhla+softmax@1)
HYBRIDS = [Arm(f"mhla+softmax@{i}", ("model.attention=mhla", f"mhla.layers=@keep{i}"), "ablation")
           for i in range(MODEL["depth"])]
# MHLA with more, smaller blocks (the paper's M) at 256 tokens, [rows, columns] of blocks: 8x8 blocks of 2x2
# tokens (M^2 = 4096 > N); 16x16 blocks of one token (the learned mixing alone can place every token);
# and blocks of two tokens one column wide (8x16) or one row tall (16x8), which tell whether the shapes'
# left-right mirror needs blocks one column wide: run only when named
BLOCK_ARMS = [Arm(f"mhla-blocks{a}x{b}", ("model.attention=mhla", f"mhla.blocks=[{a},{b}]"), "ablation")
              for a, b in ((8, 8), (16, 16), (8, 16), (16, 8))]
NAMED_ONLY = [*HYBRIDS, *BLOCK_ARMS]


def with_layers(arm: Arm, depth: int) -> Arm:
    """``arm`` with ``mhla.layers=@keepL`` made the MHLA layers of a depth-``depth`` model that keeps
    layer ``L`` as softmax."""
    keep = [o for o in arm.overrides if o.startswith("mhla.layers=@keep")]
    if not keep:
        return arm
    layer = int(keep[0].removeprefix("mhla.layers=@keep"))
    if depth < 2 or layer >= depth:
        raise ConfigError(f"--ablations {arm.name}: the model has {depth} layer(s); keeping layer {layer} "
                          "as softmax needs it to exist and at least one MHLA layer beside it")
    layers = f"mhla.layers=[{','.join(str(i) for i in range(depth) if i != layer)}]"
    return Arm(arm.name, tuple(layers if o == keep[0] else o for o in arm.overrides), arm.group)


def check_blocks(arm: Arm, side: int) -> Arm:
    """``arm``, refused when its own ``mhla.blocks=[a,b]`` asks for more blocks per axis than the
    ``side`` x ``side`` token grid has tokens."""
    for o in arm.overrides:
        if o.startswith("mhla.blocks="):
            blocks = [int(b) for b in o.removeprefix("mhla.blocks=").strip("[]").split(",")]
            if max(blocks) > side:
                raise ConfigError(f"--ablations {arm.name}: {blocks} blocks do not fit a {side}x{side} "
                                  "token grid (at most one block per token)")
    return arm


def grid_key(data: str, name: str) -> str:
    """The GRIDS key (and folder under --out) of grid ``name`` of ``data``: digits keep the bare name."""
    return name if data == "digits" else f"{data}-{name}"


def grid_model(grid: dict) -> dict:
    return dict(TINY_MODEL, patch_size=grid.get("patch", 2)) if grid.get("tiny") else MODEL


def base_overrides(grid: dict, model: dict) -> list[str]:
    steps = grid["steps"]
    return [
        f"data.source={grid.get('data', 'digits')}", f"data.resolution={grid['resolution']}",
        f"mhla.blocks=[{grid['blocks'][0]},{grid['blocks'][1]}]",
        *(f"model.{k}={v}" for k, v in model.items()),
        f"train.global_batch_size={grid['batch']}", f"train.lr_warmup_steps={min(50, steps // 10)}",
        f"log.every={max(1, steps // 30)}", "log.trackers=[]", "log.num_samples=1",
        f"log.sample_steps={grid['sample_steps']}", *grid.get("recipe", ()),
    ]


def eval_steps(steps: int) -> list[int]:
    return sorted({max(1, steps // 4), max(1, steps // 2), steps})


def plan(args) -> list:
    """Every job of the study (both grids, all arms and seeds)."""
    jobs = []
    for name in args.grids:
        chosen = {"steps": args.steps, "fid_samples": args.fid_samples, "val_triples": args.val_triples}
        grid = dict(GRIDS[name], **{k: v for k, v in chosen.items() if v})
        model = grid_model(grid)
        base, seeds = base_overrides(grid, model), list(range(args.first_seed, args.first_seed + args.seeds))
        extra = {"grid": name, "tokens": (grid["resolution"] // model["patch_size"]) ** 2,
                 "commit": results.code_commit()}
        arms = [next(a for a in MAIN_ARMS if a.name == n) for n in args.arms]
        steps = sorted({*args.eval_steps, grid["steps"]}) if args.eval_steps else eval_steps(grid["steps"])
        if steps[-1] > grid["steps"]:
            raise ConfigError(f"--eval-steps {steps[-1]} is past the budget of --grids {name} "
                              f"({grid['steps']} steps; --steps sets it)")
        jobs += make_jobs(args.out / name, CONFIG, base, arms, seeds, steps,
                          grid["fid_samples"], extra, grid.get("val_triples", VAL_TRIPLES))
        named = [a for a in (*ABLATIONS, *NAMED_ONLY) if a.name in args.ablations]
        side = grid["resolution"] // model["patch_size"]
        ablations = [check_blocks(with_layers(a, model["depth"]), side) for a in named]
        if name.split("-")[-1] in ("256", "smoke") and ablations:  # at the end of the budget
            ablation_seeds = seeds[:args.ablation_seeds or args.seeds]
            jobs += make_jobs(args.out / name, CONFIG, base, ablations, ablation_seeds, [grid["steps"]],
                              grid["fid_samples"], extra, grid.get("val_triples", VAL_TRIPLES))
    return jobs


# ------------------------------------------------------------------------------------------ throughput
def throughput(tokens: int, repeats: int = 5) -> dict[str, dict]:
    """Training (forward + backward + AdamW) and inference images/s of the study's model for each
    attention at ``tokens`` tokens (batch 8192 / tokens, at least 2), timed interleaved in this process
    (medians over ``repeats``)."""
    batch = max(2, 8192 // tokens)
    resolution = 2 * int(round(tokens**0.5))
    grid = dict(GRIDS["64" if tokens <= 64 else "256"], resolution=resolution)  # 2x2 or 4x4 blocks
    models, times = {}, {arm.name: {"train": [], "infer": []} for arm in MAIN_ARMS}
    for arm in MAIN_ARMS:
        cfg = load_config(DiTRunConfig, CONFIG, [*base_overrides(grid, MODEL), *arm.overrides])
        model = DiTTask(cfg).build_transformer()
        models[arm.name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(batch, 1, resolution, resolution)
    t, y = torch.randint(0, 1000, (batch,)), torch.randint(0, 10, (batch,))
    for _ in range(repeats + 1):  # the first round warms up
        for name, (model, opt) in models.items():
            start = time.perf_counter()
            model(x, timestep=t, class_labels=y).sample.square().mean().backward()
            opt.step()
            opt.zero_grad()
            middle = time.perf_counter()
            with torch.no_grad():
                model(x, timestep=t, class_labels=y)
            times[name]["train"].append(middle - start)
            times[name]["infer"].append(time.perf_counter() - middle)
    return {name: {k: batch / float(np.median(v[1:])) for k, v in d.items()} for name, d in times.items()}


# ------------------------------------------------------------------------------------------ report
def fmt(s: dict, digits: int = 2) -> str:
    """``mean ± ci (min–max)``."""
    ci = "" if np.isnan(s["ci"]) else f" ± {s['ci']:.{digits}f}"
    return f"{s['mean']:.{digits}f}{ci} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


METRICS = ("fid", "fid_bootstrap_sd", "val_loss", "label_accuracy", "loss", "attention_rank",
           "attention_entropy")
SHAPES_METRICS = ("all_correct", "count_accuracy", "colour_accuracy", "shape_accuracy", "symmetric_rate",
                  "symmetry_error")
# Each comparison's primary metric, declared before a run (chosen 2026-11-28, after the runs of
# docs/results/mhla_vs_softmax.md and its sibling pages, which read FID and every property alike): the
# validation loss on the digits (the denoiser's own objective on held-out triples, the least noisy
# score), all four properties on the shapes (what that data set is for). Every other column is a
# secondary under Holm's rule.
PRIMARY = {"digits": "val_loss", "shapes": "all_correct"}
SECONDARY = {"digits": ("fid", "label_accuracy"),
             "shapes": ("val_loss", "fid", "count_accuracy", "colour_accuracy", "shape_accuracy",
                        "symmetric_rate", "symmetry_error")}


def questions(arms: list[str], data: str) -> list[Question]:
    """The study's comparisons among ``arms``: MHLA against softmax and against linear attention, and
    each MHLA ablation against plain MHLA, each with ``data``'s :data:`PRIMARY` metric."""
    pairs = [("MHLA against softmax", "mhla", "softmax"), ("MHLA against linear", "mhla", "linear")]
    pairs += [(f"{a} against plain MHLA", a, "mhla") for a in arms if a.startswith("mhla") and a != "mhla"]
    return [Question(name, a, b, PRIMARY.get(data)) for name, a, b in pairs if a in arms and b in arms]


def grid_tables(records: list[dict], grid: str, samples: SampleSets | None = None) -> str:
    """The final-step table, the curves and the paired comparisons of one grid, as markdown (per-sample
    scores from ``samples``: a :class:`studies.evidence.SampleSets` or a record's)."""
    recs = [r for r in records if r["grid"] == grid]
    last = max(r["step"] for r in recs)
    arms = list(dict.fromkeys(r["arm"] for r in recs))
    shapes = recs[0].get("data") == "shapes"
    stats = {m: summarize(recs, m) for m in METRICS + (SHAPES_METRICS if shapes else ())}
    r0 = recs[0]
    seeds = stats["fid"][(arms[0], last)]["n"]
    head = (f"**{r0['tokens']} tokens, {r0.get('data', 'digits')}**: mean ± 95 % t-interval over {seeds} "
            f"seeds (min–max; fewer where the seeds column says so), at step {last}; FID on "
            f"{r0['fid_samples']} samples (the same noise and labels for every arm and seed), validation "
            f"loss on {r0.get('val_triples', '—')} fixed held-out triples; attention rank of "
            f"{r0['attention_tokens']}, row entropy of at most {r0['max_entropy']:.2f} nats")
    return "\n".join([head, "", final_table(stats, arms, last, shapes, recs),
                      curve_table(recs, stats, "fid"), curve_table(recs, stats, "val_loss"),
                      paired_table(recs, arms, last, samples), bucket_table(recs, arms, samples)])


def old_scorer_note(recs: list[dict]) -> str:
    """The footnote for shapes properties measured with the scorer's version 1 (records without
    ``shapes_scorer``), or nothing."""
    if recs[0].get("data") != "shapes" or all("shapes_scorer" in r for r in recs):
        return ""
    from studies.evidence import NOTES

    return "\n" + NOTES["old scorer"] + " (every property column of such records)\n"


def final_table(stats: dict, arms: list[str], last: int, shapes: bool, recs: list[dict] | None = None) -> str:
    names = ["FID ↓", "FID sampling sd", "val loss ↓", "label acc ↑", "train loss", "attn rank",
             "row entropy"]
    metrics, digits = list(METRICS), [2, 2, 4, 3, 4, 1, 3]
    if shapes:
        names[4:4] = ["all 4 properties ↑", "count ↑", "colour ↑", "shape ↑", "symmetric ↑",
                      "symmetry error ↓"]
        metrics[4:4], digits[4:4] = SHAPES_METRICS, [3, 3, 3, 3, 3, 3]
    lines = ["| arm | seeds | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for arm in arms:
        cells = [fmt(stats[m][(arm, last)], d) if (arm, last) in stats[m] else "—"
                 for m, d in zip(metrics, digits)]
        lines.append(f"| {arm} | {stats['fid'][(arm, last)]['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + (old_scorer_note(recs) if shapes and recs else "")


def curve_table(recs: list[dict], stats: dict, metric: str) -> str:
    """``metric`` at every evaluation step, for the arms evaluated along training (the main arms)."""
    steps = sorted({r["step"] for r in recs})
    arms = [a for a in dict.fromkeys(r["arm"] for r in recs) if all((a, s) in stats[metric] for s in steps)]
    lines = [f"{metric} along training:", "", "| arm | " + " | ".join(f"step {s}" for s in steps) + " |",
             "|---|" + "---|" * len(steps)]
    digits = 4 if metric == "val_loss" else 2
    for arm in arms:
        lines.append(f"| {arm} | " + " | ".join(fmt(stats[metric][(arm, s)], digits) for s in steps) + " |")
    return "\n".join(lines) + "\n"


def comparisons(arms: list[str]) -> list[tuple[str, str]]:
    return [(q.arm, q.other) for q in questions(arms, "digits")]


DIGITS = {"fid": 2, "val_loss": 4, "label_accuracy": 3, "symmetry_error": 3}  # decimals (rates: 3)
HEADS = {"fid": "FID", "val_loss": "val loss", "label_accuracy": "label acc",
         "all_correct": "all 4 properties", "count_accuracy": "count", "colour_accuracy": "colour",
         "shape_accuracy": "shape", "symmetric_rate": "symmetric", "symmetry_error": "symmetry error"}


def paired_table(recs: list[dict], arms: list[str], last: int, samples: SampleSets | None = None) -> str:
    """Each question (:func:`questions`) paired by seed at the last step: its primary metric first, then
    the secondaries (Holm-adjusted), each an interval over seeds and the shared samples resampled jointly
    (per-sample scores from ``samples``), its verdict and minimum detectable difference (MDD)."""
    data = recs[0].get("data", "digits")
    metrics = (PRIMARY[data], *SECONDARY[data])
    lines = [f"Paired by seed, at step {last} (first minus second; {RULES}):", "",
             "| comparison | seeds | " + " | ".join(f"{HEADS[m]} difference" for m in metrics) + " |",
             "|---|---|" + "---|" * len(metrics)]
    every = []
    for q in questions(arms, data):
        cells = apply_holm([compare(recs, q.arm, q.other, m, last, samples) for m in metrics], primary=0)
        every += cells
        text = [fmt_comparison(c, DIGITS.get(m, 3)) for c, m in zip(cells, metrics)]
        lines.append(f"| {q.arm} − {q.other} | {cells[0]['n']} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n" + footnotes(every) + "\n"


def bucket_table(recs: list[dict], arms: list[str], samples: SampleSets | None = None) -> str:
    """The paired validation-loss difference per timestep bucket (``val_loss_b{k}``), at every evaluated
    step: exploratory (no primary), Holm over each row's buckets. The total is dominated by the least
    noisy bucket (the ε error is largest there), while a sample's layout is decided at the noisier
    ones."""
    buckets = [f"val_loss_b{k}" for k in range(sum(key.startswith("val_loss_b") for key in recs[0]))]
    if not buckets:  # records of an earlier version
        return ""
    steps = sorted({r["step"] for r in recs})
    per_bucket = recs[0].get("val_triples", 0) // len(buckets)
    few = f" Only {per_bucket} triples per bucket (fewer than 256)." if per_bucket < 256 else ""
    lines = ["Validation loss per timestep bucket, paired by seed (b0 the least noisy of "
             f"{len(buckets)} equal ranges of the training timesteps; first minus second; exploratory: no "
             f"primary, each row's buckets Holm-adjusted; minimum effect 2 % of the second arm's bucket "
             f"loss; verdicts as above).{few}", "",
             "| comparison | step | " + " | ".join(buckets) + " |", "|---|---|" + "---|" * len(buckets)]
    every = []
    for a, b in comparisons(arms):
        for step in steps:
            cells = apply_holm([compare(recs, a, b, k, step, samples) for k in buckets])
            every += cells
            if cells[0]["n"]:
                row = " | ".join(fmt_comparison(c, 5) for c in cells)
                lines.append(f"| {a} − {b} | {step} | {row} |")
    return "\n".join(lines) + "\n" + footnotes(every) + "\n"


def throughput_table(rows: dict[int, dict]) -> str:
    names = [a.name for a in MAIN_ARMS]
    lines = ["| tokens | " + " | ".join(f"{n} train img/s | {n} infer img/s" for n in names) + " |",
             "|---|" + "---|---|" * len(names)]
    for tokens, row in rows.items():
        cells = [f"{row[n]['train']:.1f} | {row[n]['infer']:.1f}" for n in names]
        lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(records: list[dict], grid: str, path: Path) -> None:
    """FID and validation loss along training per main arm: mean over seeds, band = 95 % t-interval
    (min–max with one seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if r["grid"] == grid and r["group"] == "main"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, metric, label in zip(axes, ("fid", "val_loss"), ("FID (lower is better)", "validation loss")):
        stats = summarize(recs, metric)
        plot_arm_bands(ax, stats, recs, alpha=0.15)
        ax.set(xlabel="training step", ylabel=label, yscale="log")
    axes[0].set_title(f"{recs[0]['tokens']} tokens, {recs[0].get('data', 'digits')}: mean, band = 95 % CI",
                      fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    results.save_figure(fig, path)


def shown_samples(records: list[dict], grid: str) -> list[dict]:
    """The points whose kept samples :func:`plot_samples` shows: each main arm's first seed at the last
    step."""
    main = [r for r in records if r["grid"] == grid and r["group"] == "main"]
    first = min((r["seed"] for r in main), default=0)
    recs = [r for r in main if r["seed"] == first]
    last = max((r["step"] for r in recs), default=0)
    return [r for r in recs if r["step"] == last]


def kept_samples(records: list[dict], out: Path, grids: list[str]) -> dict[tuple[str, str], np.ndarray]:
    """``{(grid, arm): the kept samples}`` of :func:`shown_samples` in the study folder ``out``."""
    kept = {}
    for grid in grids:
        for r in shown_samples(records, grid):
            path = out / grid / "results" / r["arm"] / f"seed{r['seed']}" / f"step{r['step']:07d}_samples.npy"
            if path.is_file():
                kept[(grid, r["arm"])] = np.load(path)
    return kept


def plot_samples(records: list[dict], grid: str, images: dict, path: Path) -> bool:
    """Ten samples of each class per main arm (the first seed, the last step), side by side, from
    ``images`` (:func:`kept_samples`); False (nothing written) where none was kept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in shown_samples(records, grid) if (grid, r["arm"]) in images]
    if not recs:
        return False
    fig, axes = plt.subplots(1, len(recs), figsize=(3.2 * len(recs), 3.5))
    for ax, r in zip(np.atleast_1d(axes), recs):
        samples = images[(grid, r["arm"])]
        rows = [np.concatenate(list(samples[i::10][:10]), axis=0) for i in range(min(10, len(samples)))]
        ax.imshow(np.concatenate(rows, axis=1), cmap="gray", vmin=0, vmax=255)  # (rows, cols[, 3])
        ax.set_title(f"{r['arm']}: FID {r['fid']:.1f}", fontsize=9)
        ax.axis("off")
    fig.tight_layout()
    results.save_figure(fig, path)
    return True


def render(record, folder: Path) -> list[Path]:
    """``study.md`` and the plots of a study's record (:mod:`eval/results.py`) in ``folder``, from the
    record alone; returns the files written."""
    meta, points, samples = record.meta, record.points, record.samples()
    how = results.how_it_ran(meta)
    text = [f"# Softmax / linear / MHLA study\n\n`{meta['command']}` — {meta['date']}, {how}, "
            f"torch {meta['torch']}; training and evaluation summed over all runs: "
            f"{sum(r.get('segment_seconds', 0) for r in points) / 3600:.1f} core-hours\n",
            results.commits_line(points) + "\n"]
    files = [folder / "study.md"]
    for grid in meta["grids"]:
        text.append(grid_tables(points, grid, samples))
        if any(r["grid"] == grid and r["group"] == "main" for r in points):  # not with ablations only
            plot_curves(points, grid, folder / f"curves_{grid}.png")
            files.append(folder / f"curves_{grid}.png")
            if plot_samples(points, grid, record.images, folder / f"samples_{grid}.png"):
                files.append(folder / f"samples_{grid}.png")
    if meta.get("throughput"):
        text.append("Throughput of the study's model (images/s; batch 8192 / tokens; the three attentions "
                    f"timed interleaved in one process, {meta['threads']} threads):\n\n"
                    + throughput_table(meta["throughput"]))
    atomic_write_text(folder / "study.md", "\n".join(text))
    return files


def write_report(args, records: list[dict], speed: dict, seconds: float) -> str:
    """The call's record (``OUT/record.npz``), the report rendered from it and ``study.json``."""
    meta = {"grids": args.grids, "report_only": args.report_only, "wall_seconds": seconds, "jobs": args.jobs,
            "throughput": speed, "threads": torch.get_num_threads(), "configs": getattr(args, "configs", [])}
    record = results.build("study", args.command, records, args.out, meta,
                           kept_samples(records, args.out, args.grids))
    results.save(record, args.out / "record.npz")
    render(results.load(args.out / "record.npz"), args.out)  # as regenerating from the file renders it
    everything = {"command": args.command, "records": records, "throughput": speed, **file_record("study")}
    atomic_write_text(args.out / "study.json", json.dumps(everything, indent=1))
    return (args.out / "study.md").read_text()


def check_names(flag: str, names: list[str], choices: list[Arm]) -> None:
    """Each of ``names`` must be one of ``choices``' names, once (``ConfigError`` naming ``flag``)."""
    known = [a.name for a in choices]
    if any(n not in known for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"{flag} {' '.join(names)}: each must be one of {known}, once")


def select_grids(args) -> list[str]:
    """The GRIDS keys of this call (--quick / --smoke also set seeds, jobs, ablations, throughput)."""
    if args.quick or args.smoke:
        mode = "quick" if args.quick else "smoke"
        args.seeds, args.no_throughput = min(args.seeds, 2), True
        args.jobs, args.no_ablations = (args.jobs, True) if args.quick else (1, args.no_ablations)
        return [grid_key(args.data, mode)]
    names = args.grids or (["64", "256"] if args.data == "digits" else ["256"])
    keys = [grid_key(args.data, n) for n in names]
    missing = [n for n, k in zip(names, keys) if k not in GRIDS]
    if missing:
        raise ConfigError(f"--grids {' '.join(missing)} is not a grid of --data {args.data} "
                          f"(digits: 64 256; shapes: 256 1024)")
    return keys


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=expand_path, default="runs/study")
    parser.add_argument("--data", choices=["digits", "shapes"], default="digits",
                        help="digits (8x8 upsampled; grids 64, 256) or shapes (drawn; grids 256, 1024)")
    parser.add_argument("--grids", nargs="+", choices=["64", "256", "1024"], default=None,
                        help="token counts (default: 64 256 for digits, 256 for shapes)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds --first-seed .. --first-seed + --seeds - 1 (fresh seeds: ones no earlier "
                             "reading used)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    parser.add_argument("--steps", type=int, default=None, help="training budget (default: per grid)")
    parser.add_argument("--eval-steps", type=int, nargs="+", default=None, metavar="STEP",
                        help="the main arms' evaluation steps (default: a quarter, a half and all of the "
                             "budget; the budget is always one)")
    parser.add_argument("--fid-samples", type=int, default=None)
    parser.add_argument("--val-triples", type=int, default=None,
                        help="fixed held-out (image, timestep, noise) triples of the validation loss "
                             f"({VAL_TRIPLES}: 256 per timestep bucket)")
    parser.add_argument("--arms", nargs="*", default=[a.name for a in MAIN_ARMS], metavar="ARM",
                        help="main arms to run, in this order (default: softmax linear mhla; none: "
                             "ablations only)")
    parser.add_argument("--ablations", nargs="+", default=[a.name for a in ABLATIONS], metavar="ARM",
                        help="ablation arms at 256 tokens (default: all the paper's; mhla+softmax@L, "
                             "MHLA keeping layer L as softmax, and mhla-blocksBxB, MHLA with BxB blocks, "
                             "only when named)")
    parser.add_argument("--no-ablations", action="store_true")
    parser.add_argument("--ablation-seeds", type=int, default=None,
                        help="seeds of the ablation arms (default: --seeds; the first ones)")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--report-only", action="store_true",
                        help="tables and plots from the runs finished so far; train nothing")
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized (about 10 min of 2 cores): main arms, 2 seeds, a short budget")
    parser.add_argument("--smoke", action="store_true", help="seconds: a tiny model, 4 steps, 2 seeds")
    args = parser.parse_args(argv)
    for name in ("seeds", "ablation_seeds", "jobs", "steps", "fid_samples", "val_triples"):
        if getattr(args, name) is not None and getattr(args, name) < (2 if name == "fid_samples" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.first_seed < 0:
        raise ConfigError(f"--first-seed must be >= 0, got {args.first_seed}")
    if args.eval_steps and min(args.eval_steps) < 1:
        raise ConfigError(f"--eval-steps {' '.join(map(str, args.eval_steps))}: each must be positive")
    check_names("--arms", args.arms, MAIN_ARMS)
    check_names("--ablations", args.ablations, [*ABLATIONS, *NAMED_ONLY])
    args.grids = select_grids(args)
    if args.no_ablations:
        args.ablations = []
    if not args.arms and not args.ablations:
        raise ConfigError("--arms is empty and no ablation runs: nothing to run")
    for grid in args.grids:  # every comparison's primary metric, declared before anything runs
        data = GRIDS[grid].get("data", "digits")
        check_questions(questions([*args.arms, *args.ablations], data),
                        (PRIMARY.get(data), *SECONDARY[data]), "eval/study.py")
    args.out = Path(args.out)
    args.command = "python eval/study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # a line per file of every checkpoint
    start = time.perf_counter()
    jobs = plan(args)
    records = study_records(args.out, jobs, args.jobs, args.report_only)
    for r in records:  # records of earlier versions name the digits' FID only
        r.setdefault("fid", r.get("fid_digits"))
    speed = {} if args.no_throughput else {n: throughput(n) for n in (64, 256, 1024, 4096)}
    args.configs = results.configs(jobs)
    print(write_report(args, records, speed, time.perf_counter() - start))
    return records


if __name__ == "__main__":
    run(main)
