"""Exact scores of moving-shapes clips (:mod:`mhla_gen.data.moving_shapes`), from pixels, per frame index.

Each frame of each clip is checked against the clip's class and against the motion its first two frames
set (every clip of the data set scores True everywhere):

* ``count``: the frame has exactly the class's ``1 + c % 3`` shapes: 8-connected foreground components
  (max channel > 0.5) of at least a quarter of the smallest shape's box area; so a shape that splits,
  vanishes or appears, or two that merge, fails the frame;
* ``colour``: the frame has a shape and every shape's mean colour is nearest (RGB) to the class's colour
  of the ten;
* ``motion``: frames 0 and 1 hold the same number of shapes, paired by least total distance; each shape's
  velocity is its centroid's step between them, its radius half its box in frame 0; every shape moves (at
  least half a pixel a frame); and frame ``f`` holds one shape within ``tolerance`` pixels of each
  prediction, the shape's frame-0 centroid carried ``f`` steps at that velocity and reflected at the
  borders (:func:`~mhla_gen.data.moving_shapes.bounce`, the data set's law): a shape that stands still,
  teleports, stops at a border or passes through it fails the frame;
* ``all``: the three at once; ``position_error``: the largest distance (pixels) between a prediction and
  its shape (NaN where the shapes cannot be paired).

Per-frame arrays ``(N, F)`` make quality against distance from the start a curve
(:func:`frame_curves`). The scorer reads pixels only: the class fixes what the shapes must look like, the
first two frames what they must do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import ndimage
from scipy.optimize import linear_sum_assignment

from ..data.moving_shapes import MOVING_CLASSES, bounce, class_count, class_radii
from ..data.shapes import class_colour

FOREGROUND = 0.5  # every drawn pixel has max channel 1, the background 0
MIN_SPEED = 0.5  # pixels per frame: the data set's shapes move at least 1


@dataclass
class Shapes:
    """The shapes found in one frame: ``centres`` ``(K, 2)`` (row, col), ``radii`` ``(K, 2)`` half box sizes,
    ``colours`` ``(K, 3)`` mean RGB."""

    centres: np.ndarray
    radii: np.ndarray
    colours: np.ndarray

    def __len__(self) -> int:
        return len(self.centres)


def find_shapes(frame: np.ndarray, min_area: int) -> Shapes:
    """Connected foreground components of ``frame`` ``(3, H, W)`` in [0, 1] with at least ``min_area``
    pixels."""
    mask = frame.max(axis=0) > FOREGROUND
    labelled, n = ndimage.label(mask, structure=np.ones((3, 3)))
    centres, radii, colours = [], [], []
    for index, box in enumerate(ndimage.find_objects(labelled), start=1):
        pixels = labelled[box] == index
        if pixels.sum() < min_area:
            continue
        rows, cols = np.nonzero(pixels)
        centres.append((box[0].start + rows.mean(), box[1].start + cols.mean()))
        radii.append(((box[0].stop - box[0].start - 1) / 2, (box[1].stop - box[1].start - 1) / 2))
        colours.append(frame[:, box[0], box[1]][:, pixels].mean(axis=1))
    as_array = lambda x, width: np.asarray(x, dtype=np.float64).reshape(-1, width)  # noqa: E731
    return Shapes(as_array(centres, 2), as_array(radii, 2), as_array(colours, 3))


def _pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``b`` paired with ``a``'s (least total distance) and the pairs' distances."""
    distance = np.linalg.norm(a[:, None] - b[None], axis=-1)  # (K, K)
    rows, cols = linear_sum_assignment(distance)
    return cols[np.argsort(rows)], distance[rows, cols][np.argsort(rows)]


def _predicted(first: Shapes, second: Shapes, frames: int, size: tuple[int, int]) -> tuple[np.ndarray, bool]:
    """``(F, K, 2)`` predicted centres from frames 0 and 1, and whether every shape moves."""
    order, _ = _pair(first.centres, second.centres)
    velocity = second.centres[order] - first.centres  # (K, 2)
    high = np.asarray(size, dtype=np.float64) - 1 - first.radii
    moving = bool((np.abs(velocity).max(axis=1) >= MIN_SPEED).all())
    return bounce(first.centres, velocity, first.radii, high, frames), moving


def _motion(found: list[Shapes], size: tuple[int, int], tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """Per frame: whether the shapes follow the motion of frames 0 and 1, and the largest error."""
    frames = len(found)
    ok, error = np.zeros(frames, dtype=bool), np.full(frames, np.nan)
    if not len(found[0]) or len(found[1]) != len(found[0]):
        return ok, error
    predicted, moving = _predicted(found[0], found[1], frames, size)
    for f, shapes in enumerate(found):
        if len(shapes) == len(found[0]):
            error[f] = _pair(predicted[f], shapes.centres)[1].max()
            ok[f] = moving and error[f] <= tolerance
    return ok, error


def clip_scores(videos: torch.Tensor, labels, tolerance: float | None = None) -> dict[str, np.ndarray]:
    """Per-frame checks of ``videos`` float ``(N, 3, F, H, W)`` in [0, 1] against ``labels`` ``(N,)``.

    Args:
        tolerance: pixels a shape may lie from its predicted place; default ``1.5 · min(H, W) / 32``.
    Returns:
        bool ``(N, F)`` arrays ``count``, ``colour``, ``motion``, ``all``; float ``(N, F)``
        ``position_error`` (NaN where unpaired).
    """
    x = videos.detach().float().clamp(0, 1).cpu().numpy()
    labels = np.asarray(labels)
    n, _, frames, height, width = x.shape
    tolerance = 1.5 * min(height, width) / 32 if tolerance is None else tolerance
    smallest = (2 * class_radii(MOVING_CLASSES - 1, height, width)[0] + 1) ** 2
    palette = np.stack([class_colour(c) for c in range(MOVING_CLASSES)])  # (10, 3)
    out = {name: np.zeros((n, frames), dtype=bool) for name in ("count", "colour", "motion")}
    out["position_error"] = np.full((n, frames), np.nan)
    for i, (clip, c) in enumerate(zip(x, labels)):
        found = [find_shapes(clip[:, f], smallest // 4) for f in range(frames)]
        for f, shapes in enumerate(found):
            out["count"][i, f] = len(shapes) == class_count(int(c))
            nearest = ((shapes.colours[:, None] - palette[None]) ** 2).sum(-1).argmin(-1)
            out["colour"][i, f] = len(shapes) > 0 and bool((nearest == c).all())
        out["motion"][i], out["position_error"][i] = _motion(found, (height, width), tolerance)
    out["all"] = out["count"] & out["colour"] & out["motion"]
    return out


def frame_curves(scores: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per frame index, the share of clips passing each check: ``(F,)`` per name (quality against distance
    from the start)."""
    return {name: scores[name].mean(axis=0) for name in ("count", "colour", "motion", "all")}


def score_summary(videos: torch.Tensor, labels, tolerance: float | None = None) -> dict[str, float]:
    """Means over clips and frames: ``count_accuracy``, ``colour_accuracy``, ``motion_accuracy``,
    ``all_correct``, and ``clips_all_correct`` (clips right in every frame)."""
    s = clip_scores(videos, labels, tolerance)
    return {
        "count_accuracy": float(s["count"].mean()),
        "colour_accuracy": float(s["colour"].mean()),
        "motion_accuracy": float(s["motion"].mean()),
        "all_correct": float(s["all"].mean()),
        "clips_all_correct": float(s["all"].all(axis=1).mean()),
    }
