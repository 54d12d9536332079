"""The adaptation study's report (``eval/adaptation.py``), from its record alone: per grid the FID along
stage 2 with stage 1's costs and errors, the validation loss, the shapes' properties, the declared
questions as paired comparisons, the curves, the softmax-layer sweep and the equal-compute tables
(:mod:`.adaptation_compute`), and ``adaptation.md``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mhla_gen.train.io import atomic_write_text

from . import sibling
from .adaptation_arms import SWEEP_K0, grid_model
from .adaptation_compute import equal_compute_table, plot_compute
from .evidence import NOTES, RULES, Question, SampleSets, apply_holm, compare, fmt_comparison, footnotes
from .experiments import plot_arm_bands, summarize
from .softmax_layers import sweep_table
from .teachers import TEACHER_RULE, teacher_rule

results = sibling("results")  # the record this report renders from


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

