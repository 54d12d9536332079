"""The FID family on precomputed features: FID, sFID, KID, Inception Score, precision/recall.

Features are ``(N, F)`` arrays (numpy or torch) from an extractor in :mod:`.extractors`. The Fréchet
distance is clean-fid's (scipy ``sqrtm``, the TF-FID formula); KID and the Inception Score are
torchmetrics' ``KernelInceptionDistance`` / ``InceptionScore`` fed with these features (an identity
"feature network"), with their random subsets / splits drawn from a seeded generator. Precision/recall
is written here (neither library has it). Reference statistics are ``.npz`` with ADM-compatible keys
``mu``/``sigma`` (and ``mu_s``/``sigma_s`` for sFID).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch


def _as_numpy(feats) -> np.ndarray:
    feats = feats.detach().cpu().numpy() if torch.is_tensor(feats) else np.asarray(feats)
    if feats.ndim != 2:
        raise ValueError(f"features must be (N, F), got shape {feats.shape}")
    return feats.astype(np.float64)


def feature_statistics(feats) -> tuple[np.ndarray, np.ndarray]:
    """Mean ``(F,)`` and covariance ``(F, F)`` (unbiased, as ADM/clean-fid) of ``(N, F)`` features."""
    feats = _as_numpy(feats)
    if len(feats) < 2:
        raise ValueError(f"need at least 2 samples for a covariance, got {len(feats)}")
    return feats.mean(axis=0), np.cov(feats, rowvar=False)


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """``||mu1 - mu2||² + Tr(S1 + S2 - 2 (S1 S2)^½)``: clean-fid's implementation (TF-FID numerics).

    A singular ``S1 S2`` is normal: a feature with zero variance (a ReLU unit that never fires, as some of
    the digits CNN's do) or fewer samples than features makes a covariance rank-deficient. The square
    root of the product of two PSD matrices is still well defined and clean-fid computes it (adding
    ``eps`` to the diagonals only if the result is not finite), so scipy's "Matrix is singular"
    ``LinAlgWarning`` is silenced here. Zero-variance features add nothing to the distance when both sets
    agree on them (tested); FIDs from few samples are biased upwards, so compare equal sample counts.
    """
    from cleanfid.fid import frechet_distance as cleanfid_frechet
    from scipy.linalg import LinAlgWarning

    mu1, mu2 = np.atleast_1d(mu1), np.atleast_1d(mu2)
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(f"statistics differ in size: mu {mu1.shape} vs {mu2.shape}, sigma {sigma1.shape} vs "
                         f"{sigma2.shape} (different extractors?)")
    with warnings.catch_warnings():  # scipy>=1.16 deprecates the `disp` argument clean-fid passes
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", LinAlgWarning)
        return float(cleanfid_frechet(mu1, sigma1, mu2, sigma2))


def fid_from_features(real, fake) -> float:
    """FID between two ``(N, F)`` feature sets."""
    return frechet_distance(*feature_statistics(real), *feature_statistics(fake))


def _torchmetrics_on_features(cls, **kwargs):
    """A torchmetrics image metric whose "feature network" is the identity: it takes features directly.
    (Its note that all features stay in memory is what we do anyway, so it is silenced.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*will save all extracted features in buffer.*")
        return cls(feature=torch.nn.Identity(), sync_on_compute=False, **kwargs)


def _seeded_compute(metric, seed: int) -> tuple[float, float]:
    """``metric.compute()`` with torch's global RNG (its subset / split draws) seeded, then restored."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mean, std = metric.compute()
    return float(mean), float(std)


def kernel_inception_distance(
    real, fake, num_subsets: int = 100, subset_size: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """KID (Bińkowski et al.): torchmetrics' ``KernelInceptionDistance`` on ``(N, F)`` features.

    The mean and (population) std over ``num_subsets`` random subsets of ``min(len(real), len(fake),
    subset_size)`` rows of the unbiased MMD² with the kernel ``k(a, b) = (aᵀb / F + 1)³``, in float64.
    Subsets come from ``seed`` (torchmetrics draws them from torch's global RNG, which is restored).
    """
    from torchmetrics.image.kid import KernelInceptionDistance

    real, fake = torch.from_numpy(_as_numpy(real)), torch.from_numpy(_as_numpy(fake))
    m = min(len(real), len(fake), subset_size)
    if m < 2:
        raise ValueError(f"KID needs at least 2 samples per set, got {len(real)} real and {len(fake)} fake")
    metric = _torchmetrics_on_features(KernelInceptionDistance, subsets=num_subsets, subset_size=m)
    metric.update(real, real=True)
    metric.update(fake, real=False)
    return _seeded_compute(metric, seed)


def inception_score(logits, splits: int = 10, seed: int = 0) -> tuple[float, float]:
    """IS = exp(E_x KL(p(y|x) || p(y))): torchmetrics' ``InceptionScore`` on logits of any classifier.

    Mean and (sample) std over ``splits`` splits of a random permutation (drawn from ``seed``). Uniform
    predictions give 1; confident predictions spread evenly over K classes give K.
    """
    from torchmetrics.image.inception import InceptionScore

    logits = torch.from_numpy(_as_numpy(logits))
    splits = max(1, min(splits, len(logits)))
    metric = _torchmetrics_on_features(InceptionScore, splits=splits)
    metric.update(logits)
    if splits > 1:
        return _seeded_compute(metric, seed)
    with warnings.catch_warnings():  # the std of one split: torch warns and returns nan
        warnings.filterwarnings("ignore", message=r"std\(\): degrees of freedom")
        return _seeded_compute(metric, seed)[0], 0.0


def _kth_neighbour_radii(feats: torch.Tensor, k: int, batch: int = 1024) -> torch.Tensor:
    """Distance from every point to its k-th nearest other point in the same set. ``(N,)``."""
    radii = []
    for chunk in feats.split(batch):
        dist = torch.cdist(chunk, feats)  # (b, N); the self-distance 0 is the 1st "neighbour"
        radii.append(dist.kthvalue(k + 1, dim=1).values)
    return torch.cat(radii)


def _coverage(points: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor, batch: int = 1024) -> float:
    """Fraction of ``points`` inside at least one ball (centre, radius)."""
    inside = [(torch.cdist(chunk, centres) <= radii[None]).any(dim=1) for chunk in points.split(batch)]
    return torch.cat(inside).double().mean().item()


def precision_recall(real, fake, k: int = 3) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al., 2019) with k-NN manifold estimates.

    Each set's manifold is the union of balls around its points with radius = distance to the k-th
    nearest neighbour. precision = fraction of fake samples inside the real manifold; recall = fraction of
    real samples inside the fake manifold. Neither torchmetrics nor clean-fid implements it, hence this
    direct (exact, batched cdist) version of the reference algorithm; ADM's evaluator uses k = 3.
    """
    real, fake = torch.from_numpy(_as_numpy(real)), torch.from_numpy(_as_numpy(fake))
    if min(len(real), len(fake)) <= k:
        raise ValueError(f"precision/recall with k={k} needs more than {k} samples per set, "
                         f"got {len(real)} real and {len(fake)} fake")
    precision = _coverage(fake, real, _kth_neighbour_radii(real, k))
    recall = _coverage(real, fake, _kth_neighbour_radii(fake, k))
    return precision, recall


REFERENCE_STATS = "reference_stats"  # the file kind (mhla_gen.outputs.folders.file_is_ours)
REFERENCE_STATS_RECORD = "mhla_gen_kind"


def save_reference_stats(path: str | os.PathLike, feats: dict[str, np.ndarray], extractor_name: str) -> None:
    """Write ``mu``, ``sigma`` (ADM keys), ``mu_s``/``sigma_s`` when spatial features exist, the pool
    features themselves (``features``, needed by KID and precision/recall) and the extractor name."""
    mu, sigma = feature_statistics(feats["pool"])
    arrays = {"mu": mu, "sigma": sigma, "features": feats["pool"].astype(np.float32),
              "extractor": np.asarray(extractor_name)}
    if "spatial" in feats:
        arrays["mu_s"], arrays["sigma_s"] = feature_statistics(feats["spatial"])
    arrays[REFERENCE_STATS_RECORD] = np.asarray(REFERENCE_STATS)  # marks the file as ours (outputs.folders)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.npz")  # written whole, then renamed: never half a file
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def load_reference_stats(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a stats ``.npz`` (ours or ADM's reference batches, which also carry ``mu``/``sigma``)."""
    with np.load(path) as data:
        if "mu" not in data or "sigma" not in data:
            raise ValueError(f"{str(path)!r} has no 'mu'/'sigma' arrays (keys: {sorted(data.keys())})")
        return {key: data[key] for key in data.files if key != REFERENCE_STATS_RECORD}
