"""The FID family on precomputed features: FID, sFID, KID, Inception Score, precision/recall.

Features are ``(N, F)`` arrays (numpy or torch) from an extractor in :mod:`.extractors`. The Fréchet
distance is clean-fid's (scipy ``sqrtm``, the TF-FID formula); KID's unbiased polynomial-kernel MMD is
torchmetrics' estimator in numpy (the tests check it against ``poly_mmd``). Reference statistics are
``.npz`` with ADM-compatible keys ``mu``/``sigma`` (and ``mu_s``/``sigma_s`` for sFID).
"""

from __future__ import annotations

import os
import warnings

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
    """``||mu1 - mu2||² + Tr(S1 + S2 - 2 (S1 S2)^½)``: clean-fid's implementation (TF-FID numerics)."""
    from cleanfid.fid import frechet_distance as cleanfid_frechet

    mu1, mu2 = np.atleast_1d(mu1), np.atleast_1d(mu2)
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(f"statistics differ in size: mu {mu1.shape} vs {mu2.shape}, sigma {sigma1.shape} vs "
                         f"{sigma2.shape} (different extractors?)")
    with warnings.catch_warnings():  # scipy>=1.16 deprecates the `disp` argument clean-fid passes
        warnings.simplefilter("ignore", DeprecationWarning)
        return float(cleanfid_frechet(mu1, sigma1, mu2, sigma2))


def fid_from_features(real, fake) -> float:
    """FID between two ``(N, F)`` feature sets."""
    return frechet_distance(*feature_statistics(real), *feature_statistics(fake))


def polynomial_mmd(x: np.ndarray, y: np.ndarray) -> float:
    """Unbiased MMD² with the KID kernel ``k(a, b) = (aᵀb / F + 1)³`` (diagonals of k_xx, k_yy dropped).

    The estimator of torchmetrics' ``poly_mmd`` / clean-fid's ``kernel_distance``, in numpy: under a busy
    CPU, torch's intra-op threads made the same 200×200 kernels 100× slower than numpy's BLAS.
    """
    m, dim = len(x), x.shape[1]
    k_xx, k_yy, k_xy = (x @ x.T / dim + 1) ** 3, (y @ y.T / dim + 1) ** 3, (x @ y.T / dim + 1) ** 3
    within = (k_xx.sum() - np.trace(k_xx) + k_yy.sum() - np.trace(k_yy)) / (m * (m - 1))
    return float(within - 2 * k_xy.sum() / m**2)


def kernel_inception_distance(real, fake, num_subsets: int = 100, subset_size: int = 1000,
                              seed: int = 0) -> tuple[float, float]:
    """KID: mean and std over random subsets of :func:`polynomial_mmd`.

    Subsets are drawn with a seeded generator (clean-fid draws from numpy's global RNG and returns no
    std), so results are reproducible.
    """
    real, fake = _as_numpy(real), _as_numpy(fake)
    m = min(len(real), len(fake), subset_size)
    if m < 2:
        raise ValueError(f"KID needs at least 2 samples per set, got {len(real)} real and {len(fake)} fake")
    rng = np.random.default_rng(seed)
    subset = lambda feats: feats[rng.choice(len(feats), m, replace=False)]
    values = np.asarray([polynomial_mmd(subset(real), subset(fake)) for _ in range(num_subsets)])
    return float(values.mean()), float(values.std())


def inception_score(logits, splits: int = 10) -> tuple[float, float]:
    """IS = exp(E_x KL(p(y|x) || p(y))), mean and std over ``splits`` contiguous splits.

    Written out (5 lines) because torchmetrics' ``InceptionScore`` is bound to its own Inception network;
    this takes logits (or log-probabilities) from any classifier. Uniform predictions give 1, confident
    predictions spread evenly over K classes give K.
    """
    logits = torch.from_numpy(_as_numpy(logits))
    splits = max(1, min(splits, len(logits)))
    scores = []
    for part in logits.chunk(splits):
        log_p = torch.log_softmax(part, dim=-1)  # (n, K)
        log_marginal = torch.logsumexp(log_p, dim=0) - np.log(len(part))  # log p(y): (K,)
        kl = (log_p.exp() * (log_p - log_marginal)).sum(dim=-1)  # (n,)
        scores.append(kl.mean().exp().item())
    return float(np.mean(scores)), float(np.std(scores))


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


def save_reference_stats(path: str | os.PathLike, feats: dict[str, np.ndarray], extractor_name: str) -> None:
    """Write ``mu``, ``sigma`` (ADM keys), ``mu_s``/``sigma_s`` when spatial features exist, the pool
    features themselves (``features``, needed by KID and precision/recall) and the extractor name."""
    mu, sigma = feature_statistics(feats["pool"])
    arrays = {"mu": mu, "sigma": sigma, "features": feats["pool"].astype(np.float32),
              "extractor": np.asarray(extractor_name)}
    if "spatial" in feats:
        arrays["mu_s"], arrays["sigma_s"] = feature_statistics(feats["spatial"])
    np.savez(path, **arrays)


def load_reference_stats(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a stats ``.npz`` (ours or ADM's reference batches, which also carry ``mu``/``sigma``)."""
    with np.load(path) as data:
        if "mu" not in data or "sigma" not in data:
            raise ValueError(f"{str(path)!r} has no 'mu'/'sigma' arrays (keys: {sorted(data.keys())})")
        return {key: data[key] for key in data.files}
