"""The softmax / linear / MHLA study's plots (``eval/study.py``): the learning curves of the main arms and
the kept samples of each main arm side by side."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import sibling
from .experiments import plot_arm_bands, summarize

results = sibling("results")  # the record's figures are saved through it (data in a text chunk)


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

