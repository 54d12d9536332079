"""Captioned video folders, decoded with PyAV (imageio as the fallback reader)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .images import _SkippingDataset, check_size, read_captions, require_dir, resize_center_crop

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".gif")


def read_frames(path, num_frames: int) -> list[Image.Image]:
    """The first ``num_frames`` RGB frames of a video (a path, or a binary file object such as a tar
    member's or a dataset cell's bytes). Raises ValueError if it is shorter."""
    frames: list[Image.Image] = []
    try:
        import av

        with av.open(path if hasattr(path, "read") else str(path)) as container:
            for frame in container.decode(video=0):
                frames.append(frame.to_image())
                if len(frames) == num_frames:
                    break
    except ImportError:  # PyAV missing: imageio (+ ffmpeg) reads the same files
        import imageio.v3 as iio

        source = path.read() if hasattr(path, "read") else str(path)
        for i, arr in enumerate(iio.imiter(source)):
            if i == num_frames:
                break
            frames.append(Image.fromarray(np.asarray(arr)[..., :3]))
    if len(frames) < num_frames:
        raise ValueError(f"{path} has {len(frames)} frames, need {num_frames}")
    return frames


def frames_to_tensor(frames: list[Image.Image], height: int, width: int) -> torch.Tensor:
    """Frames resized to cover ``height`` x ``width`` and centre-cropped -> ``(3, F, H, W)`` in [-1, 1]."""
    frames = [resize_center_crop(f.convert("RGB"), height, width) for f in frames]
    arr = np.stack([np.asarray(f, dtype=np.float32) for f in frames]) / 127.5 - 1.0  # (F, H, W, 3)
    return torch.from_numpy(arr).permute(3, 0, 1, 2).contiguous()


class CaptionedVideoFolder(_SkippingDataset):
    """Videos with captions. Items: ``{"pixels": (3, F, H, W) float in [-1, 1], "caption": str}``.

    Every frame is resized to cover ``height`` x ``width`` and centre-cropped; the first ``num_frames``
    frames are used (Wan wants ``4k + 1``).
    """

    def __init__(self, root: str | Path, num_frames: int, height: int, width: int):
        super().__init__()
        if num_frames < 1 or (num_frames - 1) % 4:
            raise ValueError(f"num_frames must be 4k + 1 (1, 5, 9, ..., 81), got {num_frames}")
        check_size("height", height)
        check_size("width", width)
        self.root = root = require_dir(root)
        files = sorted(p for p in root.rglob("*") if p.suffix.lower() in VIDEO_EXTENSIONS)
        self.captions = read_captions(root, files)
        self.paths = [f for f in files if f in self.captions]
        if not self.paths:
            raise FileNotFoundError(f"no captioned videos under {str(root)!r} (metadata.jsonl or <name>.txt)")
        self.num_frames, self.height, self.width = num_frames, height, width

    def load(self, index: int) -> dict:
        path = self.paths[index]
        frames = [
            resize_center_crop(f.convert("RGB"), self.height, self.width)
            for f in read_frames(path, self.num_frames)
        ]
        arr = np.stack([np.asarray(f, dtype=np.float32) for f in frames]) / 127.5 - 1.0  # (F, H, W, 3)
        return {
            "pixels": torch.from_numpy(arr).permute(3, 0, 1, 2).contiguous(),
            "caption": self.captions[path],
        }
