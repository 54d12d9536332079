"""The adaptation study's compute readings (``eval/adaptation.py``): the training FLOPs behind each point
(teacher + stage 1 + stage 2, or the teacher a sunk cost), the from-scratch point matched to a
conversion's FLOPs, the teacher rule, the equal-compute table and the plot of quality against FLOPs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mhla_gen.metrics.flops import Conversion

from . import sibling
from .evidence import RULES, SampleSets, apply_holm, compare, fmt_comparison, footnotes
from .experiments import summarize
from .teachers import TEACHER_RULE, teacher_rule

results = sibling("results")  # the record's figures are saved through it (data in a text chunk)


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


def conversion_arms(records: list[dict]) -> list[str]:
    """Every arm of ``records`` but the from-scratch one, in the records' order: whatever ``--arms`` ran."""
    return [arm for arm in dict.fromkeys(r["arm"] for r in records) if arm != "mhla-scratch"]


READINGS = {False: "equal total compute (teacher + stage 1 + stage 2 FLOPs)",
            True: "equal compute with the teacher a sunk cost (stage 1 + stage 2 FLOPs)"}
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

