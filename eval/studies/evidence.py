"""Evidence that decides: what the studies score samples with, and each paired comparison's interval,
verdict and minimum detectable difference (the statistics themselves: :mod:`studies.evidence_stats`).

* :class:`DataScores` — per data source (``digits``, ``shapes``): the real images a Frechet distance
  compares with, the feature CNN, the held-out images of the validation loss, and the property scores
  (label accuracy; for shapes also the exact pixel properties of :mod:`mhla_gen.metrics.shapes`), per
  sample and summarised.
* :class:`SampleSets` — the per-sample scores each evaluation point keeps (``step<n>_features.npz``).
* :func:`compare` — the paired comparison of two arms at one step over the seeds both have: the interval
  of seeds and shared samples resampled jointly, the stated minimum effect, the floor of a rate, the
  minimum detectable difference from a pilot (:data:`PILOTS`) and the verdict; :func:`apply_holm` for the
  secondaries of a question (:class:`Question`: one primary metric, declared before the run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from mhla_gen.errors import ConfigError
from mhla_gen.metrics.extractors import digits_extractor, extract_features
from mhla_gen.metrics.fid import feature_statistics, fid_from_features, frechet_distance

from . import evidence_stats as es

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
        """Images for the validation loss (see :mod:`studies.validation_loss`)."""
        if self.source == "shapes":
            from mhla_gen.data.shapes import HELD_OUT_SEED, shapes_tensors

            return shapes_tensors(self.resolution, 1000, seed=HELD_OUT_SEED)
        return self.real()

    def extractor(self):
        if self.source == "shapes":
            from mhla_gen.metrics.shapes import shapes_extractor

            return shapes_extractor()
        return digits_extractor()

    def real_features(self) -> np.ndarray:
        return _real_features(self.source, self.resolution)

    def score(self, fake: torch.Tensor, labels: list[int]) -> tuple[dict, np.ndarray, dict[str, np.ndarray]]:
        """Scores of ``fake`` ``(N, C, R, R)`` in [0, 1] drawn for ``labels``: the summary (``fid``,
        ``fid_bootstrap_sd``, ``label_accuracy`` (the CNN's), for shapes the properties and
        ``shapes_scorer``), the pool features ``(N, F)`` and the per-sample scores (``label_correct``; for
        shapes each property, :data:`PER_SAMPLE`'s keys) that :func:`compare`'s intervals resample."""
        feats = extract_features(self.extractor(), fake)
        real = self.real_features()
        correct = feats["logits"].argmax(-1) == np.asarray(labels)
        out = {"fid": fid_from_features(real, feats["pool"]),
               "fid_bootstrap_sd": fid_bootstrap(real, feats["pool"])["sd"],
               "label_accuracy": float(correct.mean())}
        per_sample = {"label_correct": correct}
        if self.source == "digits":
            out["fid_digits"] = out["fid"]  # the name records of earlier studies use
        else:
            from mhla_gen.metrics.shapes import property_scores, summary_of

            per_sample.update(property_scores(fake, labels))
            out.update(summary_of({k: v for k, v in per_sample.items() if k != "label_correct"}))
        return out, feats["pool"].astype(np.float32), per_sample


@lru_cache(maxsize=4)
def _real(source: str, resolution: int) -> tuple[torch.Tensor, torch.Tensor]:
    if source == "shapes":
        from mhla_gen.data.shapes import shapes_tensors

        return shapes_tensors(resolution, SHAPES_REFERENCE, seed=2)
    if source != "digits":
        raise ValueError(f"the studies score data.source digits or shapes, got {source!r}")
    from mhla_gen.data.digits import digits_tensors

    return digits_tensors(resolution)


@lru_cache(maxsize=4)
def _real_features(source: str, resolution: int) -> np.ndarray:
    return extract_features(DataScores(source, resolution).extractor(), _real(source, resolution)[0])["pool"]


def interval(values: list[float], level: float = 0.95) -> dict:
    """Mean, min, max and the ``level`` t-interval of the mean over seeds (half-width ``ci``): the
    per-arm description of the tables (decisions come from :func:`compare`)."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    n = len(x)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    return {"mean": float(x.mean()), "min": float(x.min()), "max": float(x.max()), "ci": half, "n": n}


def fid_bootstrap(real: np.ndarray, fake: np.ndarray, draws: int = 50, seed: int = 0) -> dict:
    """The FID of ``fake`` ``(N, F)`` against ``real`` features, over ``draws`` resamples of the fake
    rows with replacement: ``{"sd", "values"}`` (the sampling noise of one arm's evaluation, recorded as
    ``fid_bootstrap_sd``; paired comparisons resample jointly instead, :func:`compare`)."""
    rng, stats = np.random.default_rng(seed), feature_statistics(real)  # the reference's once
    values = [frechet_distance(*stats, *feature_statistics(fake[rng.integers(0, len(fake), len(fake))]))
              for _ in range(draws)]
    return {"sd": float(np.std(values, ddof=1)), "values": values}


# ------------------------------------------------------------------------------------------ the rules
# The smallest difference worth finding, per metric: relative to the reference arm's mean, or absolute.
MIN_EFFECTS = {"fid": ("relative", 0.10), "val_loss": ("relative", 0.02),
               "label_accuracy": ("absolute", 0.05), "all_correct": ("absolute", 0.05),
               "count_accuracy": ("absolute", 0.05), "colour_accuracy": ("absolute", 0.05),
               "shape_accuracy": ("absolute", 0.05), "symmetric_rate": ("absolute", 0.05),
               "symmetry_error": ("relative", 0.10)}
# Metrics that are a fraction of the scored samples (``fid_samples`` of them).
RATES = ("label_accuracy", "all_correct", "count_accuracy", "colour_accuracy", "shape_accuracy",
         "symmetric_rate")
# The shapes scorer's metrics (mhla_gen.metrics.shapes): marked when a record predates its version 2.
SHAPES_SCORED = ("all_correct", "count_accuracy", "colour_accuracy", "shape_accuracy", "symmetric_rate",
                 "symmetry_error")
# An arm whose pooled rate (every seed's samples) has a 95 % Wilson upper bound at or below this does not
# draw the property: both arms there is "neither", not equivalence. The shapes scorer passes none of the
# adversarial images (tests/test_shapes_scores.py); label accuracy's floor would be chance, not used.
FLOORS = {m: 0.02 for m in ("all_correct", "count_accuracy", "colour_accuracy", "shape_accuracy",
                            "symmetric_rate")}
# Where each metric's per-sample scores sit in a point's ``step<n>_features.npz`` (new records; ``val``
# since the validation loss was added, ``pool`` since the sample features were kept).
PER_SAMPLE = {"label_accuracy": "label_correct", "all_correct": "all", "count_accuracy": "count",
              "colour_accuracy": "colour", "shape_accuracy": "shape", "symmetric_rate": "symmetric",
              "symmetry_error": "symmetry_error"}
BUCKETS = 4  # validation-loss timestep buckets (studies.validation_loss.bucket_means)
MEAN_DRAWS, FID_DRAWS, RESAMPLE_SEED = 2000, 200, 0  # the joint bootstrap of every report


def min_effect(metric: str, reference_mean: float) -> float:
    """The stated minimum effect of ``metric`` (:data:`MIN_EFFECTS`) for a reference arm's mean; a
    validation-loss bucket (``val_loss_b2``) has the validation loss's."""
    family = "val_loss" if metric.startswith("val_loss_b") else metric
    kind, size = MIN_EFFECTS.get(family, ("relative", 0.10))
    return size * abs(reference_mean) if kind == "relative" else size


# The pilots the minimum detectable differences come from: the spread (sd over seeds) of one seed's
# paired difference in an earlier 3-seed comparison, never the comparison being judged. The rates were
# scored by the shapes scorer's version 1; its symmetry error had other units (no pilot now).
PILOT_SOURCES = {
    "shapes-4800": "docs/results/mhla_vs_softmax.md, 'MHLA learns the shapes' mirror later than softmax' "
                   "(2026-11-27): MHLA − softmax at step 4800, shapes at 256 tokens, seeds 0-2, 300 "
                   "samples; sd of the per-seed differences of its table",
    "shapes-buckets": "docs/results/mhla_vs_softmax.md, 'The validation loss per timestep bucket' "
                      "(2026-11-26): MHLA − softmax unclipped at step 1200, seeds 0-2; sd = half-width "
                      "sqrt(3) / t(0.975, 2)",
    "shapes-lora": "docs/results/stage2_schedules.md, LoRA-style stage 2 (2026-11-27): stage2-lora − "
                   "mhla-stage1 on the shapes, 3 seeds; sd = half-width sqrt(3) / t(0.975, 2)",
    "digits-lora": "docs/results/adaptation_lora_64.md (2026-11-27): stage2-lora − mhla-stage1 at step "
                   "400, digits at 64 tokens, 3 seeds; sd = half-width sqrt(3) / t(0.975, 2)",
}
PILOTS = {  # (data, metric) -> (seed-level sd of one seed's paired difference, PILOT_SOURCES key)
    ("shapes", "fid"): (117.4, "shapes-4800"), ("shapes", "val_loss"): (0.00160, "shapes-4800"),
    ("shapes", "all_correct"): (0.0618, "shapes-4800"), ("shapes", "count_accuracy"): (0.0753, "shapes-4800"),
    ("shapes", "colour_accuracy"): (0.0091, "shapes-4800"),
    ("shapes", "symmetric_rate"): (0.0516, "shapes-4800"),
    ("shapes", "val_loss_b0"): (0.00869, "shapes-buckets"),
    ("shapes", "val_loss_b1"): (0.00290, "shapes-buckets"),
    ("shapes", "val_loss_b2"): (0.000185, "shapes-buckets"),
    ("shapes", "val_loss_b3"): (0.0000403, "shapes-buckets"),
    ("shapes", "label_accuracy"): (0.0153, "shapes-lora"),
    ("digits", "fid"): (9.42, "digits-lora"), ("digits", "val_loss"): (0.000403, "digits-lora"),
    ("digits", "val_loss_b2"): (0.0000443, "digits-lora"),
    ("digits", "label_accuracy"): (0.0237, "digits-lora"),
}


def pilot_sd(data: str, metric: str) -> float:
    """The pilot's seed-level sd for ``metric`` on ``data`` (NaN where no pilot measured it)."""
    return PILOTS.get((data, metric), (math.nan, ""))[0]


# ------------------------------------------------------------------------------------------ samples
class SampleSets:
    """The per-sample scores every evaluation point keeps beside its record, under a study folder
    ``root``: ``<root>/<grid>/results/<arm>/seed<k>/step<n>_features.npz`` (``pool``: the sample features;
    ``val``: the per-triple validation losses; newer records also :data:`PER_SAMPLE`'s arrays). A
    record relabelled to another step (the equal-compute table) names its own with ``result_step``.

    :func:`compare` reads any object with these three methods (``arrays``, ``fid_draws``, ``count``):
    ``eval/results.py`` serves the same from a study's committed record, without the run folder."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._arrays: dict[Path, dict | None] = {}
        self._fids: dict[Path, tuple[float, np.ndarray]] = {}

    def path(self, record: dict) -> Path:
        step = record.get("result_step", record["step"])
        return (self.root / str(record.get("grid", "")) / "results" / record["arm"] / f"seed{record['seed']}"
                / f"step{step:07d}_features.npz")

    def arrays(self, record: dict) -> dict | None:
        path = self.path(record)
        if path not in self._arrays:
            self._arrays[path] = dict(np.load(path)) if path.is_file() else None
        return self._arrays[path]

    def count(self, record: dict) -> int:
        """How many samples the record's FID is of (its joint resamples draw that many indices)."""
        return self.arrays(record)["pool"].shape[0]

    def fid_draws(self, record: dict) -> tuple[float, np.ndarray] | None:
        """The record's FID and its :data:`FID_DRAWS` joint resamples (:func:`evidence_stats.fid_draws`)."""
        path, arrays = self.path(record), self.arrays(record)
        if arrays is None or "pool" not in arrays or "data" not in record:
            return None
        if path not in self._fids:
            real = DataScores(record["data"], record["resolution"]).real_features()
            self._fids[path] = es.fid_draws(real, arrays["pool"], FID_DRAWS, RESAMPLE_SEED)
        return self._fids[path]


def _per_sample(metric: str, arrays: dict | None) -> tuple[np.ndarray, tuple[int, ...] | None] | None:
    """``metric``'s per-sample scores in a point's arrays and its strata (the validation loss: its
    timestep buckets), or None."""
    if arrays is None:
        return None
    if metric == "val_loss" or metric.startswith("val_loss_b"):
        if "val" not in arrays:
            return None
        parts = np.array_split(arrays["val"], BUCKETS)
        if metric == "val_loss":
            return arrays["val"], tuple(len(p) for p in parts)
        return parts[int(metric.removeprefix("val_loss_b"))], None
    key = PER_SAMPLE.get(metric)
    return (arrays[key].astype(float), None) if key in arrays else None


def _sample_interval(metric: str, pairs: list[tuple[dict, dict]], samples: SampleSets) -> es.Interval | None:
    """The joint-bootstrap interval from the points' per-sample scores (None where any is missing)."""
    if metric == "fid":
        draws = [(samples.fid_draws(a), samples.fid_draws(b)) for a, b in pairs]
        if any(x is None for pair in draws for x in pair):
            return None
        if len({samples.count(r) for pair in pairs for r in pair}) != 1:
            return None  # sample sets of different sizes are not resampled with the same indices
        full_a, full_b = (np.array([pair[k][0] for pair in draws]) for k in (0, 1))
        boot_a, boot_b = (np.stack([pair[k][1] for pair in draws]) for k in (0, 1))
        return es.interval_from(es.paired_draws(full_a, full_b, boot_a, boot_b), full_a - full_b)
    found = [(_per_sample(metric, samples.arrays(a)), _per_sample(metric, samples.arrays(b)))
             for a, b in pairs]
    if any(x is None for pair in found for x in pair) or len({x[0].shape for p in found for x in p}) != 1:
        return None
    a, b = (np.stack([pair[k][0] for pair in found]) for k in (0, 1))  # (S, N) each
    strata = found[0][0][1]
    per_seed = (a - b) @ es.full_weights(a.shape[1], strata)
    return es.interval_from(es.paired_means(a, b, MEAN_DRAWS, RESAMPLE_SEED, strata), per_seed)


def _bound(metric: str, pairs: list[tuple[dict, dict]]) -> float:
    """A conservative shared-sample variance for records without per-sample scores (NaN: none known):
    a rate's binomial variance of the two arms as if independent, or the FID's two bootstrap spreads,
    neither divided by the seeds (the sample set is shared)."""
    if metric in RATES and all(a.get("fid_samples") for a, _ in pairs):
        return float(np.mean([(a[metric] * (1 - a[metric]) + b[metric] * (1 - b[metric])) / a["fid_samples"]
                              for a, b in pairs]))
    if metric == "fid" and all("fid_bootstrap_sd" in a and "fid_bootstrap_sd" in b for a, b in pairs):
        return float(np.mean([a["fid_bootstrap_sd"] ** 2 + b["fid_bootstrap_sd"] ** 2 for a, b in pairs]))
    return math.nan


def _at_floor(metric: str, records: list[dict]) -> bool:
    """Whether an arm's pooled rate of ``metric`` over ``records`` (its seeds) sits at the metric's floor."""
    if metric not in FLOORS or not all(r.get("fid_samples") for r in records):
        return False
    hits = sum(r[metric] * r["fid_samples"] for r in records)
    return es.at_floor(round(hits), sum(r["fid_samples"] for r in records), FLOORS[metric])


def _value(record: dict, metric: str) -> float:
    value = record.get(metric)
    return float(value) if value is not None else math.nan


# ------------------------------------------------------------------------------------------ comparisons
def compare(records: list[dict], arm: str, other: str, metric: str, step: int,
            samples: SampleSets | None = None) -> dict:
    """The paired comparison ``arm - other`` of ``metric`` at ``step`` over the seeds both have.

    The interval resamples seeds and the shared samples jointly (:mod:`studies.evidence_stats`) from
    the points' per-sample scores in ``samples``; without them (records of earlier versions, or no
    ``samples``) its sample-level part is a conservative bound (``source`` ``bound``) or unknown
    (``none``). Returns ``mean``, half-width ``ci``, ``low``, ``high``, ``n``, ``p``, the stated
    ``min_effect`` (relative to ``other``'s mean), ``at_floor`` (both arms at a rate's floor), ``mdd``
    (from the pilot's seed spread, :data:`PILOTS`, and this comparison's shared-sample variance),
    ``verdict``, ``marks`` (``old scorer`` / ``bound`` / ``none``), ``per_seed``, ``sampling_sd`` and the
    :class:`~studies.evidence_stats.Interval` itself (``interval``)."""
    at_step = {(r["arm"], r["seed"]): r for r in records if r["step"] == step}
    seeds = sorted(s for a, s in at_step if a == arm and (other, s) in at_step
                   and math.isfinite(_value(at_step[(arm, s)], metric))
                   and math.isfinite(_value(at_step[(other, s)], metric)))
    pairs = [(at_step[(arm, s)], at_step[(other, s)]) for s in seeds]
    if not pairs:
        return {"mean": math.nan, "ci": math.nan, "n": 0, "mdd": math.nan, "min_effect": math.nan,
                "p": math.nan, "verdict": "too few seeds", "marks": (), "per_seed": {},
                "sampling_sd": math.nan}
    diffs = [_value(a, metric) - _value(b, metric) for a, b in pairs]
    found = _sample_interval(metric, pairs, samples) if samples is not None else None
    iv = found or es.bound_interval(diffs, _bound(metric, pairs))
    effect = min_effect(metric, float(np.mean([_value(b, metric) for _, b in pairs])))
    floor = _at_floor(metric, [a for a, _ in pairs]) and _at_floor(metric, [b for _, b in pairs])
    data = pairs[0][0].get("data", "digits")
    mdd = es.detectable(pilot_sd(data, metric), len(pairs), iv.var_sample)
    old = metric in SHAPES_SCORED and any("shapes_scorer" not in r for pair in pairs for r in pair)
    marks = (("old scorer",) if old else ()) + ((iv.source,) if iv.source != "bootstrap" else ())
    return {"mean": iv.estimate, "ci": iv.half_width, "low": iv.low, "high": iv.high, "n": len(pairs),
            "p": iv.p, "min_effect": effect, "at_floor": floor, "mdd": mdd,
            "verdict": es.verdict(iv, effect, floor), "marks": marks, "per_seed": dict(zip(seeds, diffs)),
            "sampling_sd": math.sqrt(iv.var_sample) if math.isfinite(iv.var_sample) else math.nan,
            "interval": iv}


def apply_holm(cells: list[dict], primary: int | None = None) -> list[dict]:
    """Holm's rule over the secondaries of one question (every cell of ``cells`` but ``primary``): each
    gets ``p_holm`` and its verdict judged with it, "inside the minimum effect" on its interval widened
    over the family (:func:`studies.evidence_stats.verdict`); the primary
    keeps its own interval's verdict and is marked ``primary``. Returns ``cells``, changed in place."""
    secondary = [i for i, c in enumerate(cells) if i != primary and c["n"]]
    family = sum(math.isfinite(cells[i]["p"]) for i in secondary)  # the tests Holm's rule counts
    for i, adjusted in zip(secondary, es.holm([cells[i]["p"] for i in secondary])):
        c = cells[i]
        c["p_holm"] = float(adjusted)
        c["verdict"] = es.verdict(c["interval"], c["min_effect"], c["at_floor"], p_adjusted=adjusted,
                                  family=family)
    if primary is not None:
        cells[primary]["primary"] = True
    return cells


@dataclass(frozen=True)
class Question:
    """A comparison a study answers: ``arm`` against ``other``, judged on one ``primary`` metric read at
    ``step`` (``end`` of the budget, or the evaluated step nearest a ``quarter`` of it), declared here
    before a run; every other metric of its row is a secondary under Holm's rule (:func:`apply_holm`)."""

    name: str
    arm: str
    other: str
    primary: str | None
    step: str = "end"


def check_questions(questions: list[Question], metrics: tuple[str, ...], what: str) -> None:
    """Refuse (``ConfigError``, before any work) a question without a primary metric, or with one the
    study does not measure (``metrics``) or at a step it does not read."""
    for q in questions:
        if not q.primary or q.primary not in metrics or q.step not in ("end", "quarter"):
            raise ConfigError(f"{what}: question {q.name!r} ({q.arm} − {q.other}) needs a primary metric "
                              f"declared before the run, one of {', '.join(m for m in metrics if m)} at step "
                              f"'end' or 'quarter'; got {q.primary!r} at {q.step!r}")


# ------------------------------------------------------------------------------------------ tables
MARKS = {"old scorer": "†", "bound": "‡", "none": "§"}
NOTES = {
    "old scorer": "† measured with the shapes scorer's version 1 (records before 2026-11-28; "
                  "docs/evaluation.md#the-shapes-scores): not the property its name says",
    "bound": "‡ the shared sample set's noise from a conservative bound (records without per-sample "
             "scores: binomial for a rate, the two arms' own FID bootstrap spreads), not the joint bootstrap",
    "none": "§ the shared sample set's noise unknown (records without per-sample scores): an interval over "
            "seeds alone, too narrow by that noise",
}
RULES = ("verdicts (docs/evaluation.md#verdicts): resolved = the 95 % interval (seeds and the shared samples "
         "resampled jointly) excludes 0 and the difference reaches the minimum effect (10 % of the second "
         "arm's FID, 2 % of its validation loss, 0.05 of a rate); negligible = excludes 0, inside ± the "
         "minimum effect; bounded = contains 0, inside ± it; neither = both arms at a rate's floor; too few "
         "seeds = under 3; otherwise undecided. MDD: the difference 3 seeds detect with 80 % power, from a "
         "pilot's seed spread. (primary) marks each question's primary metric; the others are judged on "
         "their Holm-adjusted p, and their \"inside ± the minimum effect\" on the interval widened to level "
         "1 − 0.05/m over the m others (Bonferroni)")


def fmt_comparison(c: dict, digits: int = 2) -> str:
    """``mean ± ci **verdict**`` with the MDD, the Holm-adjusted p of a secondary, ``(primary)`` and the
    :data:`MARKS` of :func:`compare`, for a markdown cell."""
    if not c["n"]:
        return "—"
    ci = "" if math.isnan(c["ci"]) else f" ± {c['ci']:.{digits}f}"
    mdd = "" if math.isnan(c["mdd"]) else f", MDD {c['mdd']:.{digits}f}"
    holm = f", Holm p {c['p_holm']:.2g}" if math.isfinite(c.get("p_holm", math.nan)) else ""
    primary = " (primary)" if c.get("primary") else ""
    marks = "".join(MARKS[m] for m in c["marks"])
    return f"{c['mean']:+.{digits}f}{ci} **{c['verdict']}**{mdd}{holm}{primary}{marks}"


def footnotes(cells: list[dict]) -> str:
    """The :data:`NOTES` of the marks ``cells`` carry, one line each (empty when none)."""
    present = {m for c in cells for m in c.get("marks", ())}
    return "".join(f"\n{NOTES[m]}" for m in MARKS if m in present)
