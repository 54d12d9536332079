"""Evidence that decides: what the studies score samples with, the metric's own noise, and verdicts.

* :class:`DataScores` — per data source (``digits``, ``shapes``): the real images a Frechet distance
  compares with, the feature CNN, the held-out images of the validation loss, and the property scores
  (label accuracy; for shapes also the exact pixel properties of :mod:`mhla_gen.metrics.shapes`).
* :func:`fid_bootstrap` — the FID's sampling noise: its spread over samples drawn with replacement.
* :func:`paired_bootstrap` — the same for the difference of two arms whose sample ``i`` shares its
  noise and label (common random numbers): the indices are drawn once for both.
* :func:`detectable` — the minimum difference a paired comparison of ``n`` seeds detects (two-sided 5 %,
  power 80 %), and :func:`verdict` — resolved / bounded / undecided for an interval and a minimum effect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .metrics import (
    digits_extractor,
    extract_features,
    feature_statistics,
    fid_from_features,
    frechet_distance,
)

SAMPLE_SEED = 10_000  # every arm and seed samples from this seed: common random numbers
SHAPES_REFERENCE = 2000  # real shapes the Frechet distance compares with (a held-out draw)


@dataclass(frozen=True)
class DataScores:
    """How samples of data ``source`` at ``resolution`` are scored."""

    source: str
    resolution: int

    def real(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference images ``(N, C, R, R)`` in [0, 1] and their labels."""
        return _real(self.source, self.resolution)

    def held_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Images for the validation loss (see :mod:`mhla_gen.validation_loss`)."""
        if self.source == "shapes":
            from .data.shapes import HELD_OUT_SEED, shapes_tensors

            return shapes_tensors(self.resolution, 1000, seed=HELD_OUT_SEED)
        return self.real()

    def extractor(self):
        if self.source == "shapes":
            from .metrics.shapes import shapes_extractor

            return shapes_extractor()
        return digits_extractor()

    def real_features(self) -> np.ndarray:
        return _real_features(self.source, self.resolution)

    def score(self, fake: torch.Tensor, labels: list[int]) -> tuple[dict, np.ndarray]:
        """Scores of ``fake`` ``(N, C, R, R)`` in [0, 1] drawn for ``labels``, and its pool features:
        ``fid``, ``fid_bootstrap_sd``, ``label_accuracy`` (the CNN's), and for shapes the properties."""
        feats = extract_features(self.extractor(), fake)
        real = self.real_features()
        predicted = feats["logits"].argmax(-1)
        out = {"fid": fid_from_features(real, feats["pool"]),
               "fid_bootstrap_sd": fid_bootstrap(real, feats["pool"])["sd"],
               "label_accuracy": float((predicted == np.asarray(labels)).mean())}
        if self.source == "digits":
            out["fid_digits"] = out["fid"]  # the name records of earlier studies use
        else:
            from .metrics.shapes import property_summary

            out.update(property_summary(fake, labels))
        return out, feats["pool"].astype(np.float32)


@lru_cache(maxsize=4)
def _real(source: str, resolution: int) -> tuple[torch.Tensor, torch.Tensor]:
    if source == "shapes":
        from .data.shapes import shapes_tensors

        return shapes_tensors(resolution, SHAPES_REFERENCE, seed=2)
    if source != "digits":
        raise ValueError(f"the studies score data.source digits or shapes, got {source!r}")
    from .data.digits import digits_tensors

    return digits_tensors(resolution)


@lru_cache(maxsize=4)
def _real_features(source: str, resolution: int) -> np.ndarray:
    return extract_features(DataScores(source, resolution).extractor(), _real(source, resolution)[0])["pool"]


def interval(values: list[float], level: float = 0.95) -> dict:
    """Mean, min, max and the ``level`` t-interval of the mean over seeds (half-width ``ci``)."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    n = len(x)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    return {"mean": float(x.mean()), "min": float(x.min()), "max": float(x.max()), "ci": half, "n": n}


def fid_bootstrap(real: np.ndarray, fake: np.ndarray, draws: int = 50, seed: int = 0) -> dict:
    """The FID of ``fake`` ``(N, F)`` against ``real`` features, over ``draws`` resamples of the fake
    rows with replacement: ``{"sd", "values"}`` (the sampling noise of one evaluation)."""
    rng, stats = np.random.default_rng(seed), feature_statistics(real)  # the reference's once
    values = [frechet_distance(*stats, *feature_statistics(fake[rng.integers(0, len(fake), len(fake))]))
              for _ in range(draws)]
    return {"sd": float(np.std(values, ddof=1)), "values": values}


def paired_bootstrap(real: np.ndarray, a: np.ndarray, b: np.ndarray, draws: int = 50, seed: int = 0
                     ) -> dict:
    """``FID(a) - FID(b)`` and its bootstrap spread, drawing the same sample indices for both (row ``i``
    of ``a`` and ``b`` come from the same noise and label): ``{"difference", "sd"}``."""
    if a.shape != b.shape:
        raise ValueError(f"paired samples must have the same shape, got {a.shape} and {b.shape}")
    rng, stats = np.random.default_rng(seed), feature_statistics(real)
    diffs = []
    for _ in range(draws):
        idx = rng.integers(0, len(a), len(a))
        diffs.append(frechet_distance(*stats, *feature_statistics(a[idx]))
                     - frechet_distance(*stats, *feature_statistics(b[idx])))
    return {"difference": fid_from_features(real, a) - fid_from_features(real, b),
            "sd": float(np.std(diffs, ddof=1))}


def detectable(sd: float, n: int, power: float = 0.8, level: float = 0.95) -> float:
    """The minimum true paired difference a two-sided t-test at ``level`` detects with ``power`` from ``n``
    paired differences of standard deviation ``sd``: ``(t_{level} + t_{power}) sd / sqrt(n)``, df n - 1
    (normal quantiles when ``n`` is 1 and ``sd`` is a known bootstrap spread)."""
    from scipy import stats

    if n < 1 or not math.isfinite(sd):
        return math.nan
    q = (lambda p: stats.t.ppf(p, n - 1)) if n > 1 else stats.norm.ppf
    return float((q(0.5 + level / 2) + q(power)) * sd / math.sqrt(n))


def verdict(mean: float, half_width: float, min_effect: float) -> str:
    """``resolved`` when the interval ``mean +- half_width`` excludes 0, ``bounded`` when it lies inside
    ``(-min_effect, min_effect)`` (any true effect is smaller than the stated minimum), else
    ``undecided``."""
    if not (math.isfinite(mean) and math.isfinite(half_width)):
        return "undecided"
    low, high = mean - half_width, mean + half_width
    if low > 0 or high < 0:
        return "resolved"
    if -min_effect < low and high < min_effect:
        return "bounded"
    return "undecided"


# The smallest difference worth finding, per metric: relative to the reference arm's mean, or absolute.
MIN_EFFECTS = {"fid": ("relative", 0.10), "val_loss": ("relative", 0.02),
               "label_accuracy": ("absolute", 0.05),
               "all_correct": ("absolute", 0.05), "count_accuracy": ("absolute", 0.05),
               "colour_accuracy": ("absolute", 0.05), "symmetric_rate": ("absolute", 0.05)}


def min_effect(metric: str, reference_mean: float) -> float:
    """The stated minimum effect of ``metric`` (:data:`MIN_EFFECTS`) for a reference arm's mean; a
    validation-loss bucket (``val_loss_b2``) has the validation loss's."""
    family = "val_loss" if metric.startswith("val_loss_b") else metric
    kind, size = MIN_EFFECTS.get(family, ("relative", 0.10))
    return size * abs(reference_mean) if kind == "relative" else size


# Metrics that are a fraction of the scored samples (``fid_samples`` of them): their own sampling noise is
# binomial, so it is known without a bootstrap.
RATES = ("label_accuracy", "all_correct", "count_accuracy", "colour_accuracy", "symmetric_rate")


def rate_sd(p: float, q: float, samples: int) -> float:
    """The sampling spread of the difference of two rates ``p - q`` scored on ``samples`` samples each,
    as if independent (common noise only lowers it): ``sqrt((p (1 - p) + q (1 - q)) / samples)``."""
    return math.sqrt((p * (1 - p) + q * (1 - q)) / samples)


def compare(records: list[dict], arm: str, other: str, metric: str, step: int, sampling_sd: float = math.nan
            ) -> dict:
    """The paired comparison ``arm - other`` of ``metric`` at ``step`` over the seeds both have: mean, 95 %
    t half-width ``ci``, ``n``, the minimum detectable difference ``mdd`` (from the spread of the paired
    differences), the stated ``min_effect`` (relative to ``other``'s mean) and the ``verdict``;
    ``sampling_sd`` is the spread of one seed's difference from sampling alone (for the FID, the paired
    bootstrap of one sample set, when known).

    ``ci`` is never narrower than that sampling noise allows (``1.96 sampling_sd / sqrt(n)``; ``mdd``
    likewise): a few seeds can agree by chance (two seeds with the same difference give a t half-width
    of 0), which says nothing about the noise of each score. For a rate (:data:`RATES`) the noise is
    known without a bootstrap: :func:`rate_sd`."""
    at_step = {(r["arm"], r["seed"]): r for r in records if r["step"] == step}
    by_seed = {key: r.get(metric, math.nan) for key, r in at_step.items()}
    seeds = sorted(s for a, s in by_seed if a == arm and (other, s) in by_seed)
    diffs = [by_seed[(arm, s)] - by_seed[(other, s)] for s in seeds]
    if not diffs:
        return {"mean": math.nan, "ci": math.nan, "n": 0, "mdd": math.nan, "min_effect": math.nan,
                "verdict": "undecided", "sampling_sd": sampling_sd}
    s = interval(diffs)
    sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else math.nan
    if metric in RATES and all(at_step[(arm, k)].get("fid_samples") for k in seeds):
        sampling_sd = math.sqrt(np.mean([rate_sd(by_seed[(arm, k)], by_seed[(other, k)],
                                                 at_step[(arm, k)]["fid_samples"]) ** 2 for k in seeds]))
    if len(diffs) > 1 and math.isfinite(sampling_sd):
        s["ci"] = max(s["ci"], 1.959964 * sampling_sd / math.sqrt(len(diffs)))
        sd = max(sd, sampling_sd)
    effect = min_effect(metric, float(np.mean([by_seed[(other, k)] for k in seeds])))
    return {**s, "mdd": detectable(sd, len(diffs)), "min_effect": effect,
            "verdict": verdict(s["mean"], s["ci"], effect), "sampling_sd": sampling_sd,
            "per_seed": dict(zip(seeds, diffs))}


def sampling_sd(features: dict[int, tuple[str, str]], real: np.ndarray) -> float:
    """Mean over seeds of the paired bootstrap spread of ``FID(a) - FID(b)``; ``features`` maps a seed to
    the two ``step<n>_features.npz`` files (NaN when a file is missing, e.g. records of an earlier
    version)."""
    from pathlib import Path

    sds = []
    for a, b in features.values():
        if not (Path(a).is_file() and Path(b).is_file()):
            return math.nan
        sds.append(paired_bootstrap(real, np.load(a)["pool"], np.load(b)["pool"], draws=50)["sd"])
    return float(np.mean(sds)) if sds else math.nan


def fmt_comparison(c: dict, digits: int = 2) -> str:
    """``mean ± ci [verdict]`` with the minimum detectable difference, for a markdown cell."""
    if not c["n"]:
        return "—"
    ci = "" if math.isnan(c["ci"]) else f" ± {c['ci']:.{digits}f}"
    mdd = "" if math.isnan(c["mdd"]) else f", MDD {c['mdd']:.{digits}f}"
    return f"{c['mean']:+.{digits}f}{ci} **{c['verdict']}**{mdd}"
