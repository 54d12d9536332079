"""The tables of ``eval/stream_study.py`` from its records: quality per frame window, the declared paired
comparisons with their verdicts (``studies.evidence_stats``), memory and time per chunk against length.
Pure functions of the records: nothing here trains, streams or writes except :func:`plot_curves`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import stream_bed as bed
from studies import evidence_stats as es
from studies import sibling

from mhla_gen.outputs.folders import file_is_ours

results = sibling("results")  # the record's figures are saved through it (data in a text chunk)

MIN_EFFECT, FLOOR, DRAWS = 0.05, 0.02, 2000  # evidence.py's for a rate; joint resamples
DECAY_ARMS = ("softmax-kv", "global-state", "mhla-factorised")


def declared(check: str) -> list[list[str]]:
    """A set of questions on ``check``, each ``[arm a, window a, arm b, window b, check]`` (``a − b``; the
    first is the primary, the rest are secondaries, Holm-adjusted together): per-block memory against one
    global state at 8x (``long``: the longest length streamed); against the KV cache at 8x and 1x; against
    one global state at 1x; the general against the factorised mixing at 1x; per streaming arm the decay
    with distance from the start (the training length's window minus the last one)."""
    pairs = [("mhla-factorised", "global-state", "long"), ("mhla-factorised", "softmax-kv", "long"),
             ("mhla-factorised", "softmax-kv", "1x"), ("mhla-factorised", "global-state", "1x"),
             ("mhla-general", "mhla-factorised", "1x")]
    return ([[a, w, b, w, check] for a, b, w in pairs]
            + [[arm, "1x", arm, "last", check] for arm in DECAY_ARMS])


# The questions as declared for the runs of 2026-11-28 (records without questions of their own): every
# check at once (``all``).
QUESTIONS_2026_11_28 = declared("all")
# Declared 2026-11-29 (eval/stream_study.py's docstring), after the first 6000-step record (softmax-kv,
# seed 0: no frame after frame 1 passed ``motion``, so ``all`` sits at the floor in every arm whatever the
# memory) and before any MHLA arm of that run: the class colour kept with distance from the start, and
# the primary of 2026-11-28 as the last secondary. A run's record carries the questions it was asked.
QUESTIONS = [*declared("colour"), QUESTIONS_2026_11_28[0]]


def load_records(out: Path, arms, seeds: int) -> dict[str, dict[int, dict]]:
    """``{arm: {seed: arrays}}`` of the finished records (a missing one is left out)."""
    found = {}
    for arm in arms:
        for seed in range(seeds):
            path = bed.record_path(out, arm, seed)
            if file_is_ours(path, bed.KIND):
                with np.load(path) as data:
                    found.setdefault(arm, {})[seed] = {k: data[k] for k in data.files}
    return found


def window_scores(record: dict, start: int, stop: int, check: str = "all") -> np.ndarray | None:
    """``(N,)``: per clip, the share of frames ``[start, stop)`` passing ``check`` (None: not streamed)."""
    passed = record[check]
    return passed[:, start:stop].mean(axis=1) if passed.shape[1] >= stop else None


def windows(size: bed.Size) -> dict[str, tuple[int, int]]:
    """The comparison windows: ``1x`` = ``[0, F)``, ``long`` = ``[0, L)`` and ``last`` = ``[L - F, L)`` for
    the training length ``F`` and the longest streamed length ``L`` (8F)."""
    longest, frames = size.longest, size.frames
    return {"1x": (0, frames), "long": (0, longest), "last": (longest - frames, longest)}


def window_name(window: str, size: bed.Size) -> str:
    return f"{max(size.lengths)}x" if window == "long" else window


def at_floor(scores: np.ndarray) -> bool:
    """Whether a pooled rate sits at :data:`FLOOR`: the Wilson bound over every seed's clips, ``scores``
    the per-clip shares ``(S, N)`` of a window, each clip one sample with its share as its success (the
    frames of one clip are not independent trials: counted as such, 32 frames would tighten the bound
    about sixfold and read "neither" too easily)."""
    return es.at_floor(float(scores.sum()), scores.size, FLOOR)


def paired(records: dict, a: tuple[str, str], b: tuple[str, str], size: bed.Size,
           check: str = "all") -> dict | None:
    """The paired comparison of ``a = (arm, window)`` minus ``b`` on ``check`` over the seeds both have:
    rates, the interval (seeds and clips resampled jointly), and whether both sit at the floor. None: not
    streamed."""
    spans = windows(size)
    seeds = sorted(set(records.get(a[0], {})) & set(records.get(b[0], {})))
    pairs = [(window_scores(records[a[0]][s], *spans[a[1]], check),
              window_scores(records[b[0]][s], *spans[b[1]], check)) for s in seeds]
    if not seeds or any(x is None or y is None for x, y in pairs):
        return None
    xa, xb = np.stack([x for x, _ in pairs]), np.stack([y for _, y in pairs])  # (S, N)
    iv = es.interval_from(es.paired_means(xa, xb, DRAWS, 0), (xa - xb).mean(axis=1))
    floor = at_floor(xa) and at_floor(xb)
    return {"a": a, "b": b, "rate_a": float(xa.mean()), "rate_b": float(xb.mean()), "interval": iv,
            "both_at_floor": floor}


def questions(records: dict, size: bed.Size, asked: list[list[str]] = QUESTIONS) -> list[dict]:
    """The primary (``asked``'s first) and the secondaries (Holm-adjusted together), each with its
    verdict."""
    cells = []
    for arm_a, win_a, arm_b, win_b, check in asked:
        a, b = (arm_a, win_a), (arm_b, win_b)
        cell = paired(records, a, b, size, check) or {"a": a, "b": b, "interval": None}
        cells.append({**cell, "check": check})
    p_secondary = [c["interval"].p if c["interval"] is not None else math.nan for c in cells[1:]]
    adjusted = [None, *es.holm(p_secondary)]
    family = sum(math.isfinite(p) for p in p_secondary)  # the secondaries Holm's rule counts
    for index, (cell, p_adj) in enumerate(zip(cells, adjusted)):
        cell["primary"] = index == 0
        cell["p_holm"] = p_adj
        if cell["interval"] is None:  # an arm without records, or a window it does not reach
            ran = all(arm in records for arm in (cell["a"][0], cell["b"][0]))
            cell["verdict"] = "not streamed" if ran else "not run"
            continue
        p_arg = None if index == 0 else (float(p_adj) if math.isfinite(p_adj) else 1.0)
        cell["verdict"] = es.verdict(cell["interval"], MIN_EFFECT, cell["both_at_floor"], p_arg,
                                     family=1 if index == 0 else family)
    return cells


def fmt_cell(cell: dict, size: bed.Size) -> str:
    """One row of the questions table."""
    (arm_a, win_a), (arm_b, win_b) = cell["a"], cell["b"]
    name = f"`{cell['check']}`: {arm_a} [{window_name(win_a, size)}] − {arm_b} [{window_name(win_b, size)}]"
    role = "primary" if cell["primary"] else "secondary"
    iv = cell["interval"]
    if iv is None:
        return f"| {name} | {role} | – | – | – | – | {cell['verdict']} |"
    p = f"{iv.p:.3f}" if cell["primary"] else f"{cell['p_holm']:.3f} (Holm)"
    seeds = ", ".join(f"{d:+.3f}" for d in iv.per_seed)
    return (f"| {name} | {role} | {cell['rate_a']:.3f} vs {cell['rate_b']:.3f} | {iv.estimate:+.3f} "
            f"[{iv.low:+.3f}, {iv.high:+.3f}] | {seeds} | {p} | {cell['verdict']} |")


def frame_table(records: dict, size: bed.Size, check: str) -> list[str]:
    """Per arm, the mean (over seeds and clips) share of frames passing ``check`` in each window
    ``[L/2 F, L F)`` of the lengths ``L`` (``[0, F)`` for 1x), and the per-seed means."""
    frames = size.frames
    spans = [(0, frames)] + [(n // 2 * frames, n * frames) for n in size.lengths[1:]]
    head = " | ".join(f"frames {a}–{b - 1}" for a, b in spans)
    lines = [f"| arm | {head} |", "|---" * (len(spans) + 1) + "|"]
    for arm, per_seed in records.items():
        cells = []
        for a, b in spans:
            values = [window_scores(r, a, b, check) for r in per_seed.values()]
            if any(v is None for v in values):
                cells.append("–")
                continue
            seeds = "/".join(f"{v.mean():.2f}" for v in values)
            cells.append(f"{np.mean([v.mean() for v in values]):.3f} ({seeds})")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def cost_table(costs: dict, size: bed.Size) -> list[str]:
    """Per arm and length: the bytes the caches hold when the last chunk of that length is made, the peak
    allocated while making it (cache included), and the median seconds of the chunks in ``(L/2, L]``."""
    frames, chunk, lengths = size.frames, size.chunk, size.lengths
    head = " | ".join(f"{n}x: cache / peak KiB, ms" for n in lengths)
    lines = [f"| arm | {head} | peak {lengths[-1]}x / 1x |", "|---" * (len(lengths) + 2) + "|"]
    for arm, rows in costs.items():
        cells, peaks = [], []
        for n in lengths:
            last = n * frames // chunk - 1
            if last >= len(rows):
                cells.append("–")
                continue
            first = 0 if n == 1 else n // 2 * frames // chunk
            seconds = np.median([r["seconds"] for r in rows[first:last + 1]])
            row = rows[last]
            peaks.append(row["peak_bytes"])
            cells.append(f"{row['cache_bytes'] / 1024:.0f} / {row['peak_bytes'] / 1024:.0f}, "
                         f"{1000 * seconds:.0f}")
        ratio = f"{peaks[-1] / peaks[0]:.2f}" if len(peaks) == len(lengths) else "–"
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def training_table(records: dict) -> list[str]:
    """Per arm: final training loss (mean of the last log entry over seeds), training and streaming
    seconds per seed (mean)."""
    lines = ["| arm | seeds | final loss (per seed) | train s | stream s |", "|---|---|---|---|---|"]
    for arm, per_seed in records.items():
        losses = [float(r["loss"][-1]) for r in per_seed.values()]
        train = np.mean([float(r["train_seconds"]) for r in per_seed.values()])
        stream = np.mean([float(r["stream_seconds"]) for r in per_seed.values()])
        each = "/".join(f"{x:.4f}" for x in losses)
        lines.append(f"| {arm} | {len(per_seed)} | {np.mean(losses):.4f} ({each}) | {train:.0f} "
                     f"| {stream:.0f} |")
    return lines


def page(records: dict, costs: dict, size: bed.Size, command: str, date: str, code: str,
         asked: list[list[str]] = QUESTIONS) -> str:
    """The study's markdown: setup (``code``: which commit computed the records), the questions ``asked``
    with verdicts, per-frame tables, costs."""
    cells = questions(records, size, asked)
    lines = [f"# Streaming on moving shapes ({date})", "", f"    {command}", "", code, "",
             f"Size: `{size}`.", "", "## Questions (declared before the run)", "",
             f"Score: per clip, the share of a window's frames passing the question's check (`all`: count, "
             f"colour and motion at once); minimum effect {MIN_EFFECT}, floor {FLOOR} (the 95 % Wilson "
             f"bound of a pooled rate, every seed's clips its samples), {DRAWS} joint resamples of seeds and "
             "clips. A secondary's p is Holm-adjusted over the secondaries, and its \"inside ± the minimum "
             "effect\" (bounded, negligible) is read on its interval widened to level 1 − 0.05/m over the m "
             "secondaries, not on the 95 % one shown.",
             "",
             "| comparison | role | rates | difference [95 %] | per seed | p | verdict |",
             "|---|---|---|---|---|---|---|", *(fmt_cell(c, size) for c in cells), ""]
    for check in bed.CHECKS:
        lines += [f"## `{check}` per frame window (mean over seeds, per-seed means in brackets)", "",
                  *frame_table(records, size, check), ""]
    lines += ["## Training and streaming", "", *training_table(records), ""]
    if costs:
        lines += ["## Memory and time per chunk against length (batch 1, untrained weights)", "",
                  *cost_table(costs, size), ""]
    return "\n".join(lines)


def curve_checks(asked: list[list[str]]) -> tuple[str, ...]:
    """The checks :func:`plot_curves` draws for a run asked ``asked``: its primary's check first, then
    ``count`` and ``all`` (``("all", "count")`` for the runs of 2026-11-28, as they were drawn)."""
    primary = asked[0][4]
    return tuple(dict.fromkeys((primary, "count", "all"))) if primary != "all" else ("all", "count")


def plot_curves(records: dict, size: bed.Size, path: Path,
                checks: tuple[str, ...] = ("all", "count")) -> None:
    """Per frame index, the share of clips passing each of ``checks`` (mean over seeds), per arm; one panel
    per check, sharing the y axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(checks), figsize=(5 * len(checks), 3.5), sharey=True)
    for ax, check in zip(axes, checks):
        for arm, per_seed in records.items():
            curve = np.mean([r[check].mean(axis=0) for r in per_seed.values()], axis=0)
            ax.plot(np.arange(len(curve)), curve, marker=".", label=arm)
        for n in size.lengths[1:]:
            ax.axvline((n // 2) * size.frames - 0.5, color="grey", lw=0.5, ls=":")
        ax.set_xlabel(f"frame index (training length {size.frames})")
        ax.set_title(f"share of clips passing `{check}`")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    results.save_figure(fig, path, dpi=90)

