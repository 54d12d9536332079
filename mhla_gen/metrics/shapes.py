"""Scores of samples of the shapes data (:mod:`mhla_gen.data.shapes`): exact properties from pixels, and
a small CNN whose features give a Frechet distance (as the digits CNN does for the digits).

Properties (each image against its class label; every real image scores 1 / 0 exactly):

* ``symmetric``: the foreground mask (max channel > 0.5) and its mirror image agree (intersection over
  union >= 0.9); ``symmetry_error`` is the mean |x - mirror(x)| over pixels and channels;
* ``count``: the number of 8-connected foreground components of at least half the smallest shape's
  area equals the class's ``2 (1 + c % 3)``;
* ``colour``: the mean colour of the foreground is nearest (RGB) to the class's colour of the ten;
* ``all``: the three at once.

Chance levels (a model that ignores the label but draws valid images): count 1/3, colour 1/10.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data.shapes import SHAPES_CLASSES, class_colour, class_count, class_radii, shapes_tensors

FOREGROUND = 0.5  # every drawn pixel has max channel 1, the background 0


def _components(mask: np.ndarray, min_area: int) -> int:
    from scipy import ndimage

    labelled, n = ndimage.label(mask, structure=np.ones((3, 3)))
    if n == 0:
        return 0
    areas = np.bincount(labelled.ravel())[1:]
    return int((areas >= min_area).sum())


def property_scores(images: torch.Tensor, labels) -> dict[str, np.ndarray]:
    """Per-image property checks of ``images`` float ``(N, 3, R, R)`` in [0, 1] against ``labels`` (N,):
    bool arrays ``symmetric``, ``count``, ``colour``, ``all`` and float ``symmetry_error``."""
    x = images.detach().float().clamp(0, 1).cpu().numpy()
    labels = np.asarray(labels)
    resolution = x.shape[-1]
    palette = np.stack([class_colour(c) for c in range(SHAPES_CLASSES)])  # (10, 3)
    mask = x.max(axis=1) > FOREGROUND  # (N, R, R)
    mirror = mask[:, :, ::-1]
    union = (mask | mirror).sum(axis=(1, 2))
    iou = np.where(union > 0, (mask & mirror).sum(axis=(1, 2)) / np.maximum(union, 1), 0.0)
    smallest = (2 * class_radii(SHAPES_CLASSES - 1, resolution)[0] + 1) ** 2 // 2
    counts = np.array([_components(m, smallest // 2) for m in mask])
    want = np.array([2 * class_count(int(c)) for c in labels])
    fg = np.maximum(mask.sum(axis=(1, 2)), 1)[:, None]
    mean_colour = (x * mask[:, None]).sum(axis=(2, 3)) / fg  # (N, 3)
    nearest = ((mean_colour[:, None] - palette[None]) ** 2).sum(-1).argmin(-1)
    out = {
        "symmetric": iou >= 0.9,
        "count": counts == want,
        "colour": (nearest == labels) & (mask.sum(axis=(1, 2)) > 0),
        "symmetry_error": np.abs(x - x[..., ::-1]).mean(axis=(1, 2, 3)),
    }
    out["all"] = out["symmetric"] & out["count"] & out["colour"]
    return out


def property_summary(images: torch.Tensor, labels) -> dict[str, float]:
    """Means of :func:`property_scores`: ``symmetric_rate``, ``count_accuracy``, ``colour_accuracy``,
    ``all_correct``, ``symmetry_error``."""
    s = property_scores(images, labels)
    names = {"symmetric": "symmetric_rate", "count": "count_accuracy", "colour": "colour_accuracy",
             "all": "all_correct", "symmetry_error": "symmetry_error"}
    return {names[k]: float(np.mean(v)) for k, v in s.items()}


class ShapesCNN(nn.Module):
    """Three conv layers and two linear heads on 32x32 RGB shapes.

    Shapes: input (B, 3, 32, 32) -> conv+pool (B, 16, 16, 16) -> conv+pool (B, 32, 8, 8) -> conv+pool
    (B, 32, 4, 4) -> fc (B, 64) "pool" features -> head (B, 10) "logits"; a second head (B, 2) tells
    mirror-symmetric images from images whose right half was drawn independently (training only), so the
    features see symmetry and counts, not only colour.
    """

    resolution = 32
    feature_dim = 64

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1),
                                    nn.Conv2d(32, 32, 3, padding=1)])
        self.fc = nn.Linear(32 * 4 * 4, self.feature_dim)
        self.head = nn.Linear(self.feature_dim, SHAPES_CLASSES)
        self.symmetry_head = nn.Linear(self.feature_dim, 2)
        self.name = "shapes-cnn"

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        x = images.float()
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if x.shape[-2:] != (self.resolution, self.resolution):
            x = F.interpolate(x, size=(self.resolution, self.resolution), mode="bilinear",
                              align_corners=False, antialias=True)
        for conv in self.convs:
            x = F.max_pool2d(F.relu(conv(x)), 2)
        pool = F.relu(self.fc(x.flatten(1)))
        return {"pool": pool, "logits": self.head(pool), "symmetry": self.symmetry_head(pool)}


def _broken(images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Each image with its right half replaced by another image's right half of the same class (no longer
    mirror-symmetric, same colour and count)."""
    half = images.shape[-1] // 2
    n = len(images)
    partner = (torch.arange(n) + SHAPES_CLASSES * torch.randint(1, 4, (n,), generator=gen)) % n
    out = images.clone()
    out[..., half:] = images[partner][..., half:]
    return out


def train_shapes_cnn(seed: int = 0, epochs: int = 3) -> tuple[ShapesCNN, float]:
    """Train :class:`ShapesCNN` on 2000 shapes (32x32); returns (model, held-out accuracy on 1000
    images drawn with another seed)."""
    images, labels = shapes_tensors(32, 2000, seed=100 + seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = ShapesCNN()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        for batch in torch.randperm(len(images), generator=gen).split(64):
            x = torch.cat([images[batch], _broken(images[batch], gen)])
            sym = torch.cat([torch.ones(len(batch)), torch.zeros(len(batch))]).long()
            out = model(x)
            loss = F.cross_entropy(out["logits"], labels[batch].repeat(2))
            loss = loss + F.cross_entropy(out["symmetry"], sym)
            opt.zero_grad()
            loss.backward()
            opt.step()
    test, test_labels = shapes_tensors(32, 1000, seed=200 + seed)
    with torch.no_grad():
        accuracy = (model(test)["logits"].argmax(-1) == test_labels).float().mean().item()
    return model.eval(), accuracy


def shapes_extractor(cache_path: str | os.PathLike | None = None, seed: int = 0) -> ShapesCNN:
    """The shapes CNN (eval mode, no grad), trained on first use (a few seconds) and cached as safetensors
    (``~/.cache/mhla_gen/shapes_cnn_seed{seed}.safetensors``; ``$MHLA_GEN_CACHE`` overrides the folder)."""
    from .extractors import cached_cnn

    return cached_cnn(ShapesCNN, train_shapes_cnn, "shapes", cache_path, seed)
