"""The scale study's tables (``eval/scale_study.py``), from its records alone: per grid the arms' costs,
the validation-loss curve, the declared questions at the end of the budget (equal compute and equal
images, Holm's rule over the secondaries) and the primary's gap along the budget."""

from __future__ import annotations

import math

import numpy as np

from .evidence import RULES, Question, apply_holm, compare, fmt_comparison, footnotes, interval

PRIMARY = "val_loss"  # declared 2026-11-28, before any run (eval/scale_study.py): read at equal compute, end
QUESTIONS = [Question("MHLA against softmax", "mhla", "softmax", PRIMARY),
             Question("MHLA against linear", "mhla", "linear", PRIMARY)]


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


def cost_table(recs: list[dict], alone: dict[str, float] | None = None, jobs: int | None = None) -> str:
    """Per arm: FLOPs per training image, its compute ratio, steps at each end, the runs' own training
    images/s (median; measured while ``jobs`` runs share the device, so each is a share of it) and, from
    the sizing (``alone[arm]``: one process, the model alone), the device's whole speed for that arm."""
    shared = "one run at a time" if jobs == 1 else f"{jobs or 'the'} runs sharing the device"
    lines = ["| arm | training GFLOPs / image | images per reference image at equal compute | steps (equal "
             f"images, end) | steps (equal compute, end) | training images/s (the runs, median; {shared}) "
             "| training images/s (sizing: one run alone) |", "|---|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in recs):
        r0 = next(r for r in recs if r["arm"] == arm)
        speed = np.nanmedian([r["train_images_per_s"] for r in recs if r["arm"] == arm])
        ratio = r0["compute_steps"][-1] / r0["images_steps"][-1]
        own = f"{alone[arm]:.0f}" if alone and arm in alone else "—"
        lines.append(f"| {arm} | {r0['flops_per_image'] / 1e9:.4g} | {ratio:.2f} | {r0['images_steps'][-1]} "
                     f"| {r0['compute_steps'][-1]} | {speed:.0f} | {own} |")
    return "\n".join(lines) + "\n"


def sizing_speeds(sizing: dict | None, grid: str) -> dict[str, float]:
    """``{arm: training images/s}`` of ``grid`` in a sizing record (``--sizing``; none: empty)."""
    rows = (sizing or {}).get("rows", [])
    return {r["arm"]: r["images_per_s"] for r in rows if r.get("grid") == grid and "images_per_s" in r}


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


def report(records: list[dict], samples, heading: str, sizing: dict | None = None,
           jobs: int | None = None) -> str:
    """Every grid's tables (per-sample scores from ``samples``: a record's, eval/results.py; ``sizing``:
    the record's sizing, for each arm's speed alone; ``jobs``: the runs that shared the device)."""
    text = [heading]
    for name in dict.fromkeys(r["grid"] for r in records):
        recs = [r for r in records if r["grid"] == name]
        r0 = recs[0]
        blocks = "x".join(map(str, r0["blocks"]))
        text += [f"## {r0['tokens']} tokens ({r0['resolution']}x{r0['resolution']} px, blocks {blocks}), "
                 f"batch {r0['batch']}", "", cost_table(recs, sizing_speeds(sizing, name), jobs),
                 curve_table(recs),
                 decision_table(recs, samples), along_table(recs, samples)]
    return "\n".join(text)
