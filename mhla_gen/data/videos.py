"""Captioned video folders, decoded with PyAV (imageio as the fallback reader), and which frames of a clip
a training item holds (``data.frame_sampling``, ``data.frame_stride``: :class:`FrameSampling`)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .images import _SkippingDataset, check_size, read_captions, require_dir, resize_center_crop

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".gif")


@dataclass(frozen=True)
class FrameSampling:
    """Which ``num_frames`` frames of a clip an item holds.

    ``first``: frames 0, s, 2s, ... (s = ``stride``); ``uniform``: spread evenly from the first to the last
    frame of the clip; ``random``: a start drawn from ``seed`` and the item's key, then every s-th frame.
    The random start is the same each time an item is read (a feature cache encodes it once; a new
    ``seed`` draws other starts), so a run and its resume see the same clips."""

    mode: str = "first"
    stride: int = 1
    seed: int = 0


def frame_indices(total: int | None, count: int, sampling: FrameSampling, key: str = "") -> list[int]:
    """The ``count`` frame indices :class:`FrameSampling` picks from a clip of ``total`` frames (``first``
    does not need ``total``); ValueError when the clip is too short."""
    span = (count - 1) * sampling.stride + 1
    if sampling.mode == "first":
        start = 0
    elif sampling.mode == "uniform":
        if total < count:
            raise ValueError(f"the clip has {total} frames, need {count}")
        return np.linspace(0, total - 1, count).round().astype(int).tolist()
    elif sampling.mode == "random":
        if total < span:
            raise ValueError(f"the clip has {total} frames, need {span} ({count} frames at stride "
                             f"{sampling.stride})")
        rng = np.random.default_rng([sampling.seed, zlib.crc32(key.encode())])
        start = int(rng.integers(0, total - span + 1))
    else:
        raise ValueError(f"data.frame_sampling must be first, uniform or random, got {sampling.mode!r}")
    return list(range(start, start + span, sampling.stride))


def _rewound(path):
    """``path`` as the decoders open it; a file object is rewound first (it may be read twice)."""
    if hasattr(path, "read"):
        path.seek(0)
        return path
    return str(path)


def count_frames(path) -> int:
    """Frames of a video: the container's count, else its video packets (no decoding)."""
    try:
        import av
    except ImportError:  # PyAV missing: imageio decodes every frame
        import imageio.v3 as iio

        source = path.read() if hasattr(path, "read") else str(path)
        return sum(1 for _ in iio.imiter(source))
    with av.open(_rewound(path)) as container:
        stream = container.streams.video[0]
        return stream.frames or sum(1 for packet in container.demux(stream) if packet.size)


def _decode(path, wanted: list[int]) -> dict[int, Image.Image]:
    """The RGB frames ``wanted`` (indices) of a video, decoding up to the last of them."""
    found, last = {}, max(wanted)
    keep = set(wanted)
    try:
        import av

        with av.open(_rewound(path)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in keep:
                    found[i] = frame.to_image()
                if i == last:
                    break
    except ImportError:  # PyAV missing: imageio (+ ffmpeg) reads the same files
        import imageio.v3 as iio

        source = _rewound(path).read() if hasattr(path, "read") else str(path)
        for i, arr in enumerate(iio.imiter(source)):
            if i in keep:
                found[i] = Image.fromarray(np.asarray(arr)[..., :3])
            if i == last:
                break
    return found


def read_frames(
    path, num_frames: int, sampling: FrameSampling | None = None, key: str = ""
) -> list[Image.Image]:
    """``num_frames`` RGB frames of a video (a path, or a binary file object such as a tar member's or a
    dataset cell's bytes), chosen by ``sampling`` (default: the first ones; ``key`` seeds a random start).
    Raises ValueError if the video is shorter than the frames need."""
    sampling = sampling or FrameSampling()
    total = None if sampling.mode == "first" else count_frames(path)
    try:
        wanted = frame_indices(total, num_frames, sampling, key)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    frames = _decode(path, wanted)
    if len(frames) < len(wanted):  # fewer frames than the container said, or (first) than needed
        raise ValueError(f"{path} has fewer than the {wanted[-1] + 1} frames it needs ({num_frames} frames, "
                         f"data.frame_sampling={sampling.mode}, stride {sampling.stride})")
    return [frames[i] for i in wanted]


def frames_to_tensor(frames: list[Image.Image], height: int, width: int) -> torch.Tensor:
    """Frames resized to cover ``height`` x ``width`` and centre-cropped -> ``(3, F, H, W)`` in [-1, 1]."""
    frames = [resize_center_crop(f.convert("RGB"), height, width) for f in frames]
    arr = np.stack([np.asarray(f, dtype=np.float32) for f in frames]) / 127.5 - 1.0  # (F, H, W, 3)
    return torch.from_numpy(arr).permute(3, 0, 1, 2).contiguous()


class CaptionedVideoFolder(_SkippingDataset):
    """Videos with captions. Items: ``{"pixels": (3, F, H, W) float in [-1, 1], "caption": str}``.

    Every frame is resized to cover ``height`` x ``width`` (or, with ``buckets``, the bucket nearest the
    video's aspect ratio) and centre-cropped; ``num_frames`` frames (Wan wants ``4k + 1``) are chosen by
    ``frames`` (default: the first ones).
    """

    def __init__(self, root: str | Path, num_frames: int, height: int, width: int,
                 frames: FrameSampling | None = None, buckets=None):
        super().__init__(buckets)
        self.frames = frames or FrameSampling()
        if num_frames < 1 or (num_frames - 1) % 4:
            raise ValueError(f"num_frames must be 4k + 1 (1, 5, 9, ..., 81), got {num_frames}")
        check_size("height", height)
        check_size("width", width)
        self.root = root = require_dir(root)
        files = sorted(p for p in root.rglob("*") if p.suffix.lower() in VIDEO_EXTENSIONS)
        self.captions = read_captions(root, files)
        self.paths = [f for f in files if f in self.captions]
        if not self.paths:
            raise FileNotFoundError(f"no captioned videos under {str(root)!r} (metadata.jsonl, <name>.txt or "
                                    f"<name>.json)")
        self.num_frames, self.height, self.width = num_frames, height, width

    def load(self, index: int) -> dict:
        path = self.paths[index]
        frames = read_frames(path, self.num_frames, self.frames, key=str(path))
        pixels = frames_to_tensor(frames, *self.size_for(*frames[0].size))
        return {"pixels": pixels, "caption": self.captions[path]}
