"""Scores of samples of the shapes data (:mod:`mhla_gen.data.shapes`): exact properties from pixels, and
a small CNN whose features give a Frechet distance (as the digits CNN does for the digits).

Properties of each image against its class label ``c`` (scorer version :data:`SCORER_VERSION`; every
real image scores 1 on each, tested, and the adversarial tests give each property images that lack it).
The foreground is the pixels whose max channel exceeds :data:`FOREGROUND`; a *component* is an
8-connected foreground region of at least half the area of the smallest shape the data set draws
(smaller specks are ignored):

* ``count``: the number of components is the class's ``2 (1 + c % 3)``;
* ``shape``: at least one component, and every component is a disc or a square (the data set's two
  shapes, drawn as :func:`mhla_gen.data.shapes.draw_image` draws them) of a radius in the class's range:
  intersection over union >= :data:`SHAPE_IOU` with that template centred on the component;
* ``colour``: at least one component, none larger than the data set's largest shape, and every
  component has the class's colour: at least :data:`COLOUR_SHARE` of its pixels have the class's hue
  (max-channel-normalised colour within :data:`COLOUR_TOLERANCE`, half the smallest gap between two class
  colours) and its mean brightness (max channel) is at least :data:`BRIGHTNESS` (the class colours have
  value 1). Component by component: two wrong colours cannot average to the right one;
* ``symmetric``: a valid image (at least the class's count of components, none crossing the centre
  line) whose foreground and its mirror image agree (intersection over union >= 0.9): noise, a filled
  frame or half a layout mirrored is not a symmetric image of shapes;
* ``all``: the four at once;
* ``symmetry_error``: ``sum |x - mirror(x)| / sum (x + mirror(x))`` over pixels and channels, 0 for a
  mirror image and 1 for one that has nothing on one side (or nothing at all): normalised by what is
  drawn, so drawing less is not rewarded.

Version 1 (records without ``shapes_scorer``, before 2026-11-28) scored ``symmetric`` as the mask's IoU
with its mirror for any foreground (a filled image passed), ``colour`` as the mean foreground colour's
nearest class colour, ``all`` as symmetric, count and colour (no shape or size), and ``symmetry_error``
as the mean ``|x - mirror(x)|`` over the image (a blank image scored 0).

Chance levels (a model that ignores the label but draws valid images): count 1/3, colour 1/10.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data.shapes import SHAPES_CLASSES, class_colour, class_count, class_radii, shapes_tensors
from .extractors import cached_cnn

SCORER_VERSION = 2  # records carry it as ``shapes_scorer`` (none: version 1, the module docstring)
FOREGROUND = 0.5  # every drawn pixel has max channel 1, the background 0
SHAPE_IOU = 0.8  # a component against its disc / square template
COLOUR_TOLERANCE = 0.2  # max-abs distance of a pixel's hue (colour / max channel) from the class colour
COLOUR_SHARE = 0.9  # of a component's pixels that must have the class's hue
BRIGHTNESS = 0.75  # a component's mean max channel (the data set draws 1)
SYMMETRY_IOU = 0.9
PROPERTIES = ("symmetric", "count", "colour", "shape", "all")


def shape_template(kind: str, radius: int) -> np.ndarray:
    """The data set's ``disc`` or ``square`` of ``radius``: bool ``(2 r + 1, 2 r + 1)``, as
    :func:`mhla_gen.data.shapes.draw_image` draws it (its formula; tested equal on the real images)."""
    rows, cols = np.ogrid[-radius:radius + 1, -radius:radius + 1]
    if kind == "disc":
        return rows**2 + cols**2 <= radius**2 + radius // 2
    return np.ones((2 * radius + 1, 2 * radius + 1), dtype=bool)


def _limits(resolution: int) -> tuple[int, int]:
    """(minimum component area, largest side of any shape plus one pixel each way) at ``resolution``."""
    smallest = (2 * class_radii(SHAPES_CLASSES - 1, resolution)[0] + 1) ** 2 // 2
    largest = max(class_radii(c, resolution)[1] for c in range(SHAPES_CLASSES))
    return smallest // 2, 2 * largest + 3


def _is_shape(component: np.ndarray, top: int, left: int, radii: tuple[int, int]) -> bool:
    """Whether ``component`` (bool, its bounding box at ``(top, left)``) is a disc or square of a radius
    in ``radii``: IoU with the template centred on the component's centroid."""
    rows, cols = np.nonzero(component)
    cy, cx = int(round(top + rows.mean())), int(round(left + cols.mean()))
    for radius in range(radii[0], radii[1] + 1):
        r0, c0 = min(top, cy - radius), min(left, cx - radius)
        height = max(top + component.shape[0], cy + radius + 1) - r0
        width = max(left + component.shape[1], cx + radius + 1) - c0
        drawn = np.zeros((height, width), dtype=bool)
        drawn[top - r0:top - r0 + component.shape[0], left - c0:left - c0 + component.shape[1]] = component
        for kind in ("disc", "square"):
            template = np.zeros_like(drawn)
            template[cy - radius - r0:cy + radius + 1 - r0, cx - radius - c0:cx + radius + 1 - c0] = \
                shape_template(kind, radius)
            if (drawn & template).sum() >= SHAPE_IOU * (drawn | template).sum():
                return True
    return False


def _has_colour(pixels: np.ndarray, colour: np.ndarray) -> bool:
    """Whether a component's ``pixels`` ``(3, n)`` have the class ``colour`` (module docstring)."""
    value = pixels.max(axis=0)
    hue_ok = np.abs(pixels / value - colour[:, None]).max(axis=0) < COLOUR_TOLERANCE
    return bool(hue_ok.mean() >= COLOUR_SHARE and value.mean() >= BRIGHTNESS)


def _image_properties(x: np.ndarray, label: int) -> dict[str, bool]:
    """The properties of one image ``x`` float ``(3, R, R)`` in [0, 1] drawn for class ``label``."""
    from scipy import ndimage

    resolution = x.shape[-1]
    min_area, largest = _limits(resolution)
    mask = x.max(axis=0) > FOREGROUND
    labelled, _ = ndimage.label(mask, structure=np.ones((3, 3)))
    want, colour, radii = 2 * class_count(label), class_colour(label), class_radii(label, resolution)
    shapes, colours, crossing = [], [], False
    for index, box in enumerate(ndimage.find_objects(labelled), start=1):
        component = labelled[box] == index
        if component.sum() < min_area:
            continue
        crossing |= box[1].start < resolution // 2 <= box[1].stop - 1
        oversized = max(component.shape) > largest
        shapes.append(not oversized and _is_shape(component, box[0].start, box[1].start, radii))
        colours.append(not oversized and _has_colour(x[:, box[0], box[1]][:, component], colour))
    mirror = mask[:, ::-1]
    agree = (mask & mirror).sum() >= SYMMETRY_IOU * max((mask | mirror).sum(), 1)
    out = {"symmetric": len(shapes) >= want and not crossing and bool(agree),
           "count": len(shapes) == want, "colour": bool(colours) and all(colours),
           "shape": bool(shapes) and all(shapes)}
    out["all"] = all(out.values())
    return out


def symmetry_error(images: torch.Tensor) -> np.ndarray:
    """``sum |x - mirror(x)| / sum (x + mirror(x))`` per image of ``(N, C, R, R)`` in [0, 1]: 0 for a
    mirror image, 1 for an image with nothing on one side or nothing at all."""
    x = images.detach().double().clamp(0, 1).cpu().numpy()
    mirror = x[..., ::-1]
    drawn = (x + mirror).sum(axis=(1, 2, 3))
    unmatched = np.abs(x - mirror).sum(axis=(1, 2, 3))
    return np.where(drawn > 0, unmatched / np.maximum(drawn, 1e-12), 1.0)


def property_scores(images: torch.Tensor, labels) -> dict[str, np.ndarray]:
    """Per-image property checks of ``images`` float ``(N, 3, R, R)`` in [0, 1] against ``labels`` (N,):
    bool arrays ``symmetric``, ``count``, ``colour``, ``shape``, ``all`` and float ``symmetry_error``."""
    x = images.detach().float().clamp(0, 1).cpu().numpy()
    labels = np.asarray(labels)
    if x.ndim != 4 or x.shape[1] != 3 or len(labels) != len(x):
        raise ValueError(f"need RGB images (N, 3, R, R) and N labels, got {x.shape} and {labels.shape}")
    per_image = [_image_properties(image, int(c)) for image, c in zip(x, labels)]
    out = {k: np.array([p[k] for p in per_image], dtype=bool).reshape(len(x)) for k in PROPERTIES}
    out["symmetry_error"] = symmetry_error(images)
    return out


RATE_NAMES = {"symmetric": "symmetric_rate", "count": "count_accuracy", "colour": "colour_accuracy",
              "shape": "shape_accuracy", "all": "all_correct", "symmetry_error": "symmetry_error"}


def property_summary(images: torch.Tensor, labels) -> dict[str, float]:
    """Means of :func:`property_scores` (:data:`RATE_NAMES`: ``symmetric_rate``, ``count_accuracy``,
    ``colour_accuracy``, ``shape_accuracy``, ``all_correct``, ``symmetry_error``) and the scorer's
    version as ``shapes_scorer``."""
    return summary_of(property_scores(images, labels))


def summary_of(scores: dict[str, np.ndarray]) -> dict[str, float]:
    """:func:`property_summary` of per-image ``scores`` already computed by :func:`property_scores`."""
    return {**{RATE_NAMES[k]: float(np.mean(v)) for k, v in scores.items()}, "shapes_scorer": SCORER_VERSION}


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
    return cached_cnn(ShapesCNN, train_shapes_cnn, "shapes", cache_path, seed)
