"""Which layers to keep as softmax, for a given latency (issue 40, question 4b): the arms, the latency
measurement and the table behind ``eval/adaptation.py --softmax-layers``.

For every K = 1 .. depth / 2 (K = 0 is the all-MHLA ``mhla-stage1-all`` arm), three stage-1 conversions (the
default stage 1: every parameter of the converted layers) keep K layers as softmax, chosen

* ``e2e``: by what keeping each layer does to the converted model's end-to-end error on held-out inputs
  (``hybrid.softmax_layers=auto:K``, the converter's default ranking);
* ``layer``: by each layer's own remaining stage-1 error (``hybrid.rank_by=layer_error``, the proxy);
* ``fixed``: by the release's pattern, every third layer from layer 0 (``[0, 3, 6, ...][:K]``, then the
  layers after those), whatever the errors say;

then trained in stage 2 like every other arm. Latency depends only on K (softmax and MHLA layers have the
same parameters and the same cost wherever they sit), so it is timed once per K, side by side in one
process: quality against latency, one curve per ranking.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .evidence import apply_holm, compare, fmt_comparison, footnotes
from .experiments import Arm, summarize
from .teachers import TEACHER_RULE, teacher_rule

RANKINGS = {  # name -> the stage-1 overrides that choose K softmax layers of a depth-D model
    "e2e": lambda k, depth: ("hybrid.rank_by=end_to_end", f"hybrid.softmax_layers=auto:{k}"),
    "layer": lambda k, depth: ("hybrid.rank_by=layer_error", f"hybrid.softmax_layers=auto:{k}"),
    "fixed": lambda k, depth: (f"hybrid.softmax_layers=[{','.join(map(str, fixed_layers(k, depth)))}]",),
}


def fixed_layers(k: int, depth: int) -> list[int]:
    """The release's pattern cut to ``k`` layers: every third layer from 0, then the remaining layers in
    order (the Wan release keeps ``i % 3 == 0`` of 30 layers as softmax)."""
    every_third = [i for i in range(depth) if i % 3 == 0]
    return (every_third + [i for i in range(depth) if i % 3])[:k]


def sweep_ks(depth: int) -> list[int]:
    """K = 1 .. depth / 2 (at least one MHLA layer stays, at least one softmax layer is kept)."""
    return list(range(1, max(1, depth // 2) + 1))


def arm_name(ranking: str, k: int) -> str:
    return f"softmax{k}-{ranking}"


def sweep_arms(depth: int, teacher: str, stage1: tuple[str, ...]) -> list[Arm]:
    """Every (ranking, K) arm: stage 1 from ``teacher`` with ``stage1`` plus the ranking's overrides."""
    return [Arm(arm_name(ranking, k), (), "softmax layers", stage1=(teacher, *stage1, *choose(k, depth)))
            for k in sweep_ks(depth) for ranking, choose in RANKINGS.items()]


@torch.no_grad()
def latency(build, ks: list[int], resolution: int, batch: int, repeats: int = 5) -> dict[int, float]:
    """Inference milliseconds per image of ``build(k)`` (a model with ``k`` softmax layers) for each ``k``,
    timed interleaved in this process on latents ``(batch, in_channels, resolution, resolution)`` (the
    models' own channels: 1 for the digits, 3 for the shapes; medians of ``repeats`` rounds after one
    warm-up round)."""
    models = {k: build(k).eval() for k in ks}
    x = torch.randn(batch, models[ks[0]].config.in_channels, resolution, resolution)
    t, y = torch.randint(0, 1000, (batch,)), torch.randint(0, 10, (batch,))
    times = {k: [] for k in ks}
    for _ in range(repeats + 1):
        for k, model in models.items():
            start = time.perf_counter()
            model(x, timestep=t, class_labels=y)
            times[k].append(time.perf_counter() - start)
    return {k: 1000 * float(np.median(v[1:])) / batch for k, v in times.items()}


DIGITS = {"fid": 1, "val_loss": 4, "symmetric_rate": 3}  # decimals in the tables


def sweep_table(recs: list[dict], ms: dict[int, float], depth: int, k0: str, samples=None) -> str:
    """Markdown, one table per metric (FID, validation loss, and on the shapes the symmetric rate) at the
    end of stage 2: per K the measured latency, each ranking's mean ± 95 % t-interval (K = 0 is the arm
    ``k0``) and the paired comparisons e2e − fixed, e2e − layer, e2e − K0 and fixed − K0 with verdicts
    (exploratory: no primary metric, Holm over each row's four; per-sample scores from ``samples``, a
    :class:`studies.evidence.SampleSets`)."""
    step = max(r["step"] for r in recs)
    metrics = [m for m in DIGITS if any(m in r for r in recs)]
    return "\n".join([chosen_layers(recs, depth)] + [metric_table(recs, metric, step, ms, depth, k0, samples)
                                                     for metric in metrics])


def chosen_layers(recs: list[dict], depth: int) -> str:
    """The layers each sweep arm kept as softmax, per seed (from its stage 1's ``transfer.json``)."""
    kept = {(r["arm"], r["seed"]): r["stage1"]["softmax_layers"] for r in recs if "stage1" in r}
    lines = ["Layers kept as softmax (per seed):", "", "| K | e2e | layer | fixed |", "|---|---|---|---|"]
    for k in sweep_ks(depth):
        cells = [", ".join(f"{kept[key]}" for key in sorted(key for key in kept if key[0] == arm_name(r, k)))
                 or "—" for r in RANKINGS]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def metric_table(recs: list[dict], metric: str, step: int, ms: dict[int, float], depth: int, k0: str,
                 samples=None) -> str:
    """:func:`sweep_table`'s table of one metric."""
    stats, d = summarize(recs, metric), DIGITS[metric]

    def cell(arm):
        s = stats.get((arm, step))
        ci = "" if s is None or np.isnan(s["ci"]) else f" ± {s['ci']:.{d}f}"
        return "—" if s is None else f"{s['mean']:.{d}f}{ci}"

    every = []

    def row(pairs):
        cells = apply_holm([compare(recs, a, b, metric, step, samples) for a, b in pairs])
        for c, (a, _) in zip(cells, pairs):
            teacher_rule([c], recs, a, step)  # every arm of a pair starts from the same seed's teacher
        every.extend(cells)
        return [fmt_comparison(c, d) for c in cells]

    lines = [f"Softmax layers kept (of {depth}) against latency: `{metric}` at stage-2 step {step} per "
             "ranking, paired differences (verdicts as above; exploratory: Holm over each row's four; "
             f"{TEACHER_RULE}):", "",
             "| K | inference ms / image | e2e | layer | fixed | e2e − fixed | e2e − layer | e2e − K0 | "
             "fixed − K0 |", "|---|---|---|---|---|---|---|---|---|",
             f"| 0 | {ms.get(0, float('nan')):.2f} | " + " | ".join([cell(k0)] * 3 + ["—"] * 4) + " |"]
    for k in sweep_ks(depth):
        names = {r: arm_name(r, k) for r in RANKINGS}
        pairs = row([(names["e2e"], names["fixed"]), (names["e2e"], names["layer"]), (names["e2e"], k0),
                     (names["fixed"], k0)])
        values = [cell(names[r]) for r in RANKINGS]
        lines.append(f"| {k} | {ms.get(k, float('nan')):.2f} | " + " | ".join(values + pairs) + " |")
    return "\n".join(lines) + "\n" + footnotes(every) + "\n"
