"""The softmax / linear / MHLA study's report (``eval/study.py``), from its record alone: the declared
questions and their primary metrics, per grid the final-step table, the curves, the paired comparisons
and the per-bucket validation loss, the throughput table, and ``study.md`` with the plots
(:mod:`.study_plots`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mhla_gen.train.io import atomic_write_text

from . import sibling
from .evidence import NOTES, RULES, Question, SampleSets, apply_holm, compare, fmt_comparison, footnotes
from .experiments import summarize
from .study_plots import plot_curves, plot_samples
from .study_preset import MAIN_ARMS

results = sibling("results")  # the record this report renders from


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

