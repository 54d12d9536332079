"""A drawn, class-conditional data set whose content needs many tokens: mirror-symmetric coloured shapes.

The digits (8x8 upsampled) hold 64 pixels of content, so a 16x16 token grid mostly sees interpolation.
Here every pixel is drawn at the target resolution (32x32: 256 tokens at patch 2; 64x64: 1024), with
content at every scale and global properties that distant tokens must agree on:

* class ``c`` (0..9) fixes the **colour** (hue ``36 c`` degrees, full saturation: every shape of an image
  has it exactly), the **count** (``1 + c % 3`` shapes in the left half) and the **size** (large radii for
  ``c < 5``, small for the rest); each shape is a disc or a square at a random place;
* the image is **mirror-symmetric** about its vertical centre line: the right half is the left half
  flipped, so a token must agree with its mirror token half an image away;
* shapes never touch each other or the centre line (one blank pixel around each), so their count is
  exactly the number of connected components: ``2 (1 + c % 3)``.

Deterministic (numpy ``default_rng(seed)``), fast (about 0.1 ms an image), no download. Property scores
computed from pixels are in :mod:`mhla_gen.metrics.shapes`.
"""

from __future__ import annotations

import colorsys
from functools import lru_cache

import numpy as np
import torch
from torch.utils.data import Dataset

SHAPES_CLASSES = 10
TRAIN_ITEMS = 5000  # the training set (seed 0); held-out sets use other seeds
HELD_OUT_SEED = 1


def class_colour(c: int) -> np.ndarray:
    """RGB in [0, 1] of class ``c``: hue 36 c degrees, saturation and value 1 (max channel = 1)."""
    return np.array(colorsys.hsv_to_rgb((c % SHAPES_CLASSES) / SHAPES_CLASSES, 1.0, 1.0), dtype=np.float32)


def class_count(c: int) -> int:
    """Shapes in the left half of a class-``c`` image (the image holds twice as many)."""
    return 1 + c % 3


def class_radii(c: int, resolution: int) -> tuple[int, int]:
    """Smallest and largest radius (pixels) of class ``c``'s shapes at ``resolution``."""
    scale = resolution / 32
    low, high = (3, 4) if c < 5 else (2, 3)
    return max(1, round(low * scale)), max(1, round(high * scale))


def _place(rng: np.random.Generator, boxes: list, radius: int, half: int, size: int) -> tuple | None:
    """A centre ``(row, col)`` for a shape of ``radius`` in columns ``[1, half - 2]`` whose box (plus one
    blank pixel) meets no box in ``boxes``; None after 50 tries."""
    for _ in range(50):
        r = int(rng.integers(1 + radius, size - 1 - radius))
        c = int(rng.integers(1 + radius, half - 1 - radius))
        box = (r - radius, r + radius, c - radius, c + radius)
        if all(box[0] > b[1] + 1 or box[1] < b[0] - 1 or box[2] > b[3] + 1 or box[3] < b[2] - 1
               for b in boxes):
            return r, c, box
    return None


def draw_image(rng: np.random.Generator, c: int, resolution: int) -> np.ndarray:
    """One class-``c`` image, float32 ``(3, R, R)`` in [0, 1] (black background)."""
    half = resolution // 2
    low, high = class_radii(c, resolution)
    while True:  # a placement that fails (rare) redraws the whole half
        mask, boxes = np.zeros((resolution, half), dtype=bool), []
        for _ in range(class_count(c)):
            radius = int(rng.integers(low, high + 1))
            found = _place(rng, boxes, radius, half, resolution)
            if found is None:
                break
            r, col, box = found
            boxes.append(box)
            rows, cols = np.ogrid[box[0]:box[1] + 1, box[2]:box[3] + 1]
            if rng.random() < 0.5:  # disc
                shape = (rows - r) ** 2 + (cols - col) ** 2 <= radius**2 + radius // 2
            else:  # square
                shape = np.ones((2 * radius + 1, 2 * radius + 1), dtype=bool)
            mask[box[0]:box[1] + 1, box[2]:box[3] + 1] |= shape
        if len(boxes) == class_count(c):
            break
    full = np.concatenate([mask, mask[:, ::-1]], axis=1)  # (R, R) mirror-symmetric
    return full[None].astype(np.float32) * class_colour(c)[:, None, None]


@lru_cache(maxsize=8)
def _shapes_arrays(resolution: int, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, resolution])
    labels = np.arange(count) % SHAPES_CLASSES
    images = np.stack([draw_image(rng, int(c), resolution) for c in labels])
    return images, labels


def shapes_tensors(resolution: int = 32, count: int = TRAIN_ITEMS, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` images of every class in turn, drawn with ``seed`` (the training set is seed 0; a
    held-out set uses another seed, e.g. :data:`HELD_OUT_SEED`).

    Returns:
        images: float32 ``(count, 3, R, R)`` in [0, 1].
        labels: long ``(count,)`` in 0..9 (``i % 10``).
    """
    check_shapes_data(resolution, SHAPES_CLASSES)
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    images, labels = _shapes_arrays(resolution, count, seed)
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.copy()).long()


class ShapesDataset(Dataset):
    """The training set as DiT items: ``pixels`` ``(3, R, R)`` in [-1, 1] and ``class_labels``."""

    def __init__(self, resolution: int, count: int = TRAIN_ITEMS, seed: int = 0):
        images, self.labels = shapes_tensors(resolution, count, seed)
        self.pixels = images * 2.0 - 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"pixels": self.pixels[i], "class_labels": self.labels[i]}


def check_shapes_data(resolution: int, num_classes: int) -> None:
    """Start-up check of a ``data.source=shapes`` run: resolution and class count."""
    if resolution < 32 or resolution % 2:
        raise ValueError(f"data.resolution must be an even number of pixels >= 32 for data.source=shapes "
                         f"(three shapes must fit in half the width), got {resolution}")
    if num_classes != SHAPES_CLASSES:
        raise ValueError(
            f"model.num_classes={num_classes} but data.source=shapes has {SHAPES_CLASSES} classes"
        )
