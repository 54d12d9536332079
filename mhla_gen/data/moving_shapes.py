"""A drawn, class-conditional video data set with exact scores: coloured shapes moving at constant
velocity and bouncing off the borders (the video counterpart of :mod:`mhla_gen.data.shapes`).

* class ``c`` (0..9) fixes the **colour** of every shape (hue ``36 c`` degrees, as the image shapes), the
  **count** (``1 + c % 3`` shapes) and the **size** (large radii for ``c < 5``, small for the rest); each
  shape is a disc or a square, the same in every frame;
* each shape moves at a constant integer velocity (at least one pixel a frame along some axis, at most
  ``1 + size // 32``) and bounces off the borders: its centre runs back and forth between ``r`` and
  ``size - 1 - r`` (:func:`bounce`), so the shape always lies wholly inside the frame;
* the first step has no bounce, and shapes never touch each other in any frame (``max(2, size // 16)``
  blank pixels between their boxes), so frames 0 and 1 give each shape's velocity exactly and every frame
  has exactly ``1 + c % 3`` connected components.

Positions are integers, so a shape's pixel centroid is its centre exactly: the scorer
(:mod:`mhla_gen.metrics.moving_shapes`) predicts every frame from the first two and scores each frame
index separately (quality against distance from the start).

Sizes: any ``num_frames`` >= 2 and ``height``, ``width`` >= 32. For a Wan model (VAE 4x in time, 8x in
space, patch (1, 2, 2)) take ``num_frames = 4k + 1`` and multiples of 16: 13 frames of 64x64 are a
``(4, 8, 8)`` latent and a ``(4, 4, 4)`` token grid, which chunks of 1, 2 or 4 latent frames divide.
Clips are drawn one by one from ``(seed, index)`` (random access, nothing held in memory); the training set
is seed 0, held-out sets use other seeds (:data:`HELD_OUT_SEED`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from .shapes import class_colour

MOVING_CLASSES = 10
TRAIN_CLIPS = 1000
HELD_OUT_SEED = 1
COLOUR_NAMES = ("red", "orange", "lime", "green", "mint", "cyan", "azure", "blue", "violet", "pink")
COUNT_WORDS = ("one", "two", "three")


def class_count(c: int) -> int:
    """Shapes in a class-``c`` clip."""
    return 1 + c % 3


def class_radii(c: int, height: int, width: int) -> tuple[int, int]:
    """Smallest and largest radius (pixels) of class ``c``'s shapes."""
    scale = min(height, width) / 32
    low, high = (3, 4) if c < 5 else (2, 3)
    return max(1, round(low * scale)), max(1, round(high * scale))


def max_speed(height: int, width: int) -> int:
    """Largest speed along an axis, pixels per frame."""
    return 1 + min(height, width) // 32


def class_caption(c: int) -> str:
    """``"two orange shapes moving"``: the class in words (the prompt of a text-conditioned model)."""
    n = class_count(c)
    return f"{COUNT_WORDS[n - 1]} {COLOUR_NAMES[c]} shape{'s' if n > 1 else ''} moving"


def bounce(start, velocity, low, high, frames: int) -> np.ndarray:
    """Positions at frames ``0..frames-1`` of a point moving at ``velocity`` from ``start`` and reflected at
    ``low`` and ``high`` (a triangle wave of period ``2 (high - low)``). Arrays broadcast: ``start``,
    ``velocity``, ``low``, ``high`` of shape ``S`` give ``(frames, *S)``; integers in, integers out."""
    start, velocity, low, high = np.broadcast_arrays(*map(np.asarray, (start, velocity, low, high)))
    t = np.arange(frames).reshape(-1, *[1] * start.ndim)
    span = high - low
    period = np.maximum(2 * span, 1)  # span 0: the point cannot move
    u = np.mod(start - low + velocity * t, period)
    return low + np.where(span > 0, np.where(u <= span, u, period - u), 0)


@dataclass(frozen=True)
class Track:
    """One shape: ``radius``, ``disc`` (else a square), integer ``start`` and ``velocity`` as (row, col)."""

    radius: int
    disc: bool
    start: tuple[int, int]
    velocity: tuple[int, int]

    def centres(self, frames: int, height: int, width: int) -> np.ndarray:
        """``(frames, 2)`` integer centres (row, col)."""
        r = self.radius
        return bounce(self.start, self.velocity, (r, r), (height - 1 - r, width - 1 - r), frames)

    def mask(self) -> np.ndarray:
        """Bool ``(2 r + 1, 2 r + 1)`` footprint around the centre."""
        r = self.radius
        if not self.disc:
            return np.ones((2 * r + 1, 2 * r + 1), dtype=bool)
        rows, cols = np.ogrid[-r : r + 1, -r : r + 1]
        return rows**2 + cols**2 <= r**2 + r // 2  # as the image shapes' discs


def _draw_track(rng: np.random.Generator, radius: int, height: int, width: int, speed: int) -> Track:
    """A track whose first step does not bounce (frames 0 and 1 give its velocity)."""
    while True:
        velocity = tuple(int(v) for v in rng.integers(-speed, speed + 1, size=2))
        if velocity != (0, 0):
            break
    start = tuple(
        int(rng.integers(radius + max(0, -v), size - radius - max(0, v)))  # first step inside [r, size-1-r]
        for v, size in zip(velocity, (height, width))
    )
    return Track(radius, bool(rng.random() < 0.5), start, velocity)


def shape_gap(height: int, width: int) -> int:
    """Blank pixels kept between any two shapes' boxes (enough that a blurred sample keeps them apart)."""
    return max(2, min(height, width) // 16)


def _apart(track: Track, others: list[Track], frames: int, height: int, width: int) -> bool:
    """``track``'s box never comes closer to another's than :func:`shape_gap` blank pixels, in any frame."""
    centres, gap = track.centres(frames, height, width), shape_gap(height, width)
    for other in others:
        distance = np.abs(centres - other.centres(frames, height, width)).max(axis=1)  # (frames,) Chebyshev
        if (distance < track.radius + other.radius + 1 + gap).any():
            return False
    return True


def draw_tracks(rng: np.random.Generator, c: int, frames: int, height: int, width: int) -> list[Track]:
    """The shapes of one class-``c`` clip, placed one by one: a shape that would touch one already placed
    is redrawn (up to 50 times, then the whole clip is)."""
    low, high = class_radii(c, height, width)
    speed = max_speed(height, width)
    while True:
        tracks = []
        for _ in range(class_count(c)):
            for _ in range(50):
                track = _draw_track(rng, int(rng.integers(low, high + 1)), height, width, speed)
                if _apart(track, tracks, frames, height, width):
                    tracks.append(track)
                    break
            else:
                break
        if len(tracks) == class_count(c):
            return tracks


def render(tracks: list[Track], colour: np.ndarray, frames: int, height: int, width: int) -> np.ndarray:
    """float32 ``(3, F, H, W)`` in [0, 1]: the shapes in ``colour`` on black."""
    mask = np.zeros((frames, height, width), dtype=bool)
    for track in tracks:
        footprint, r = track.mask(), track.radius
        for f, (row, col) in enumerate(track.centres(frames, height, width)):
            mask[f, row - r : row + r + 1, col - r : col + r + 1] |= footprint
    return mask[None].astype(np.float32) * colour[:, None, None, None]


def moving_shapes_clip(index: int, num_frames: int, height: int, width: int, seed: int = 0
                       ) -> tuple[np.ndarray, int]:
    """Clip ``index`` of the set drawn with ``seed``: float32 ``(3, F, H, W)`` in [0, 1] and its class
    (``index % 10``). Drawn from ``(seed, index, sizes)`` alone."""
    c = index % MOVING_CLASSES
    rng = np.random.default_rng([seed, index, num_frames, height, width])
    tracks = draw_tracks(rng, c, num_frames, height, width)
    return render(tracks, class_colour(c), num_frames, height, width), c


def moving_shapes_tensors(num_frames: int, height: int, width: int, count: int, seed: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clips ``0..count-1``: float32 ``(count, 3, F, H, W)`` in [0, 1] and long labels ``(count,)``."""
    check_moving_shapes_data(num_frames, height, width)
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    clips, labels = zip(*(moving_shapes_clip(i, num_frames, height, width, seed) for i in range(count)))
    return torch.from_numpy(np.stack(clips)), torch.tensor(labels, dtype=torch.long)


class MovingShapesVideos(Dataset):
    """Captioned clips for video fine-tuning (``data.source=moving_shapes``): items ``{"pixels": (3, F, H, W)
    in [-1, 1], "caption": str, "class_labels": int}``; ``paths`` name each clip (the feature cache's key)."""

    def __init__(self, num_frames: int, height: int, width: int, count: int = TRAIN_CLIPS, seed: int = 0):
        check_moving_shapes_data(num_frames, height, width)
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.num_frames, self.height, self.width, self.seed = num_frames, height, width, seed
        self.paths = [f"moving_shapes:seed={seed}:{num_frames}x{height}x{width}#{i}" for i in range(count)]

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, index: int) -> dict:
        """Item ``index`` (what the feature cache reads; the clips never fail to load)."""
        clip, c = moving_shapes_clip(index, self.num_frames, self.height, self.width, self.seed)
        return {"pixels": torch.from_numpy(clip) * 2.0 - 1.0, "caption": class_caption(c), "class_labels": c}

    __getitem__ = load


def check_moving_shapes_data(num_frames: int, height: int, width: int) -> None:
    """Sizes the drawing supports: three shapes must fit and move."""
    if num_frames < 2:
        raise ValueError(f"data.num_frames must be >= 2 for moving shapes (motion needs two frames), got "
                         f"{num_frames}")
    for name, value in (("height", height), ("width", width)):
        if value < 32:
            raise ValueError(f"data.{name} must be >= 32 pixels for moving shapes, got {value}")
