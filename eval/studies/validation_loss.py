"""A validation loss on a fixed held-out set of (image, timestep, noise) triples: deterministic for a given
model, cheap (one forward per triple, no sampler), nearly free of noise, and comparable across arms
because every arm sees the same triples (common random numbers).

The loss is DiT's simple objective, ``mean((eps - eps_theta(x_t, t, y))^2)`` on the first ``C`` output
channels (the variance channels of a ``learn_sigma`` model are left out), with the true class label
(no CFG dropout). Timesteps are stratified: triple ``i`` of ``n`` gets a timestep in the ``i``-th of
``n`` equal slices of ``[0, T)``, so every bucket of ``buckets`` equal timestep ranges holds ``n / buckets``
triples; the result gives the mean of each bucket and their mean (the total).

Images: the held-out set of the data when it has one (shapes: drawn with another seed); the digits
have only their 1797 training images, so there the held-out part is the (timestep, noise) pairs, which
training never draws.
"""

from __future__ import annotations

import numpy as np
import torch

VALIDATION_SEED = 424242  # the triples' own seed, apart from every training and sampling seed


def validation_set(images: torch.Tensor, labels: torch.Tensor, count: int, num_timesteps: int,
                   seed: int = VALIDATION_SEED) -> dict[str, torch.Tensor]:
    """``count`` fixed triples from ``images`` ``(N, C, R, R)`` in [0, 1] and ``labels`` ``(N,)``.

    Returns ``x0`` ``(count, C, R, R)`` in [-1, 1], ``labels`` ``(count,)``, ``t`` ``(count,)`` long
    (stratified, increasing), ``noise`` ``(count, C, R, R)``."""
    if count < 1:
        raise ValueError(f"validation triples must be >= 1, got {count}")
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(images), generator=gen)
    pick = pick[torch.arange(count) % len(images)]
    slices = torch.arange(count, dtype=torch.float64) + torch.rand(count, generator=gen, dtype=torch.float64)
    t = (slices * num_timesteps / count).floor().long().clamp_(0, num_timesteps - 1)
    noise = torch.randn((count, *images.shape[1:]), generator=gen)
    return {"x0": images[pick] * 2.0 - 1.0, "labels": labels[pick], "t": t, "noise": noise}


@torch.no_grad()
def triple_losses(transformer, scheduler, vset: dict[str, torch.Tensor], batch_size: int = 128) -> np.ndarray:
    """Each triple's ``mean((eps - eps_theta)^2)``, float64 ``(count,)``; ``scheduler`` is the training
    ``DDPMScheduler`` (its ``add_noise``)."""
    was_training = transformer.training
    transformer.eval()
    device = next(transformer.parameters()).device
    channels = vset["x0"].shape[1]
    out = []
    for start in range(0, len(vset["t"]), batch_size):
        part = {k: v[start:start + batch_size].to(device) for k, v in vset.items()}
        xt = scheduler.add_noise(part["x0"], part["noise"], part["t"])
        pred = transformer(xt, timestep=part["t"], class_labels=part["labels"], return_dict=False)[0]
        err = (pred[:, :channels].float() - part["noise"].float()).square()
        out.append(err.mean(dim=(1, 2, 3)).double().cpu())
    transformer.train(was_training)
    return torch.cat(out).numpy()


def bucket_means(losses: np.ndarray, buckets: int = 4) -> dict[str, float]:
    """``val_loss`` (mean of the bucket means) and ``val_loss_b{k}`` for ``buckets`` equal timestep ranges
    (``b0`` the least noisy); ``losses`` in :func:`validation_set`'s (increasing-timestep) order."""
    parts = np.array_split(losses, buckets)
    means = {f"val_loss_b{k}": float(p.mean()) for k, p in enumerate(parts)}
    return {"val_loss": float(np.mean(list(means.values()))), **means}
