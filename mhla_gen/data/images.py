"""Image folders: ImageNet-style class folders (ADM/DiT center crop) and captioned image folders.

A missing folder raises FileNotFoundError naming it. An unreadable file is skipped with a warning that
names it and counted in ``dataset.skipped``; the item falls through to the next readable file, so one
bad JPEG in a million does not stop a run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..errors import ConfigError
from .buckets import nearest_bucket

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".JPEG", ".JPG", ".PNG")


def require_dir(path: str | Path, what: str = "data folder") -> Path:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist or is not a folder")
    return path


def check_size(name: str, value: int) -> None:
    """A pixel size must be a positive int (else every file would fail to load and look unreadable)."""
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive number of pixels, got {value!r}")


def center_crop_arr(image: Image.Image, size: int) -> Image.Image:
    """ADM / DiT preprocessing: halve with BOX while >= 2x, BICUBIC-resize the short side, centre crop."""
    while min(*image.size) >= 2 * size:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = size / min(*image.size)
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    arr = np.array(image)
    top, left = (arr.shape[0] - size) // 2, (arr.shape[1] - size) // 2
    return Image.fromarray(arr[top : top + size, left : left + size])


def resize_center_crop(image: Image.Image, height: int, width: int) -> Image.Image:
    """Scale so the image covers ``height`` x ``width`` (BICUBIC), then crop the centre."""
    scale = max(height / image.height, width / image.width)
    image = image.resize(
        (max(width, round(image.width * scale)), max(height, round(image.height * scale))),
        resample=Image.BICUBIC,
    )
    top, left = (image.height - height) // 2, (image.width - width) // 2
    return image.crop((left, top, left + width, top + height))


def to_tensor(image: Image.Image) -> torch.Tensor:
    """PIL RGB -> float32 (3, H, W) in [-1, 1]."""
    arr = np.asarray(image.convert("RGB"), dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


class _SkippingDataset(Dataset):
    """Falls through to the next item when ``load(i)`` raises on a bad file; counts the skips. Captioned
    datasets crop each item to ``height x width``, or with ``buckets`` (``[(height, width), ...]``) to the
    bucket nearest its aspect ratio (:meth:`size_for`)."""

    paths: list[Path]
    height: int
    width: int

    def __init__(self, buckets=None):
        self.skipped = 0
        self.buckets = [tuple(b) for b in buckets] if buckets else None

    def size_for(self, width: int, height: int) -> tuple[int, int]:
        """``(height, width)`` an item of ``width x height`` pixels is cropped to."""
        return nearest_bucket(width, height, self.buckets) if self.buckets else (self.height, self.width)

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, index: int) -> dict:
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict:
        for attempt in range(len(self.paths)):
            i = (index + attempt) % len(self.paths)
            try:
                return self.load(i)
            except Exception as err:  # noqa: BLE001 - any decode error of one file is a skip
                self.skipped += 1
                logger.warning(
                    "skipping unreadable file %s (%s: %s); %d skipped so far",
                    self.paths[i],
                    type(err).__name__,
                    err,
                    self.skipped,
                )
        raise RuntimeError(f"no readable file among the {len(self.paths)} in the dataset")


def check_readable(dataset: _SkippingDataset, setting: str, value, what: str = "files") -> None:
    """At least one item of ``dataset`` loads (``ConfigError`` naming ``setting=value`` otherwise): checked
    at start-up, before anything is written, since a folder of unreadable files would otherwise stop a run
    only when its first batch (or its cache) is read. Stops at the first readable item."""
    for i in range(len(dataset)):
        try:
            dataset.load(i)
            return
        except Exception:  # noqa: BLE001 - an unreadable file is skipped while training too
            continue
    raise ConfigError(f"{setting}={str(value)!r}: none of its {len(dataset)} {what} can be read")


def _is_image(path: Path) -> bool:
    """An image file by suffix; hidden files (``.DS_Store``, macOS ``._x.jpg``) are not."""
    return path.suffix in IMAGE_EXTENSIONS and not path.name.startswith(".")


def class_folders(root: str | Path, setting: str = "data path") -> list[str]:
    """Class folder names of ``root`` sorted (ids 0..K-1, torchvision ImageFolder's rule), leaving out
    hidden folders (``.ipynb_checkpoints``, ``.git``) and folders with no images, which would otherwise
    each become a class and shift every label after them; a warning names what was left out."""
    root = require_dir(root, setting)
    classes, hidden, empty = [], [], []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        if d.name.startswith("."):
            hidden.append(d.name)
        elif not any(_is_image(p) for p in d.rglob("*")):
            empty.append(d.name)
        else:
            classes.append(d.name)
    if hidden or empty:
        logger.warning(
            "%s=%s: %d class folders; left out %s", setting, root, len(classes),
            "; ".join(f"{kind}: {', '.join(names)}" for kind, names in
                      (("hidden", hidden), ("without images", empty)) if names),
        )
    if not classes:
        raise FileNotFoundError(f"no class folders with images ({', '.join(IMAGE_EXTENSIONS)}) inside "
                                f"{setting}={str(root)!r}")
    return classes


class ClassFolderDataset(_SkippingDataset):
    """``root/<class name>/<image>``: classes sorted by name -> ids 0..K-1 (torchvision ImageFolder rule),
    hidden and image-less folders left out (:func:`class_folders`).

    Items: ``{"pixels": (3, R, R) float in [-1, 1], "class_labels": long}``.
    """

    def __init__(self, root: str | Path, resolution: int, setting: str = "data path"):
        super().__init__()
        check_size("resolution", resolution)
        self.root = root = require_dir(root, setting)
        self.classes = class_folders(root, setting)
        self.paths, self.labels = [], []
        for label, name in enumerate(self.classes):
            for p in sorted((root / name).rglob("*")):
                if _is_image(p):
                    self.paths.append(p)
                    self.labels.append(label)
        self.resolution = resolution

    def load(self, index: int) -> dict:
        with Image.open(self.paths[index]) as img:
            image = center_crop_arr(img.convert("RGB"), self.resolution)
        return {"pixels": to_tensor(image), "class_labels": torch.tensor(self.labels[index])}


def json_caption(raw: str | bytes, where: str) -> str | None:
    """The caption of a JSON side file (``{"text": ...}`` or ``{"caption": ...}``, as a line of
    metadata.jsonl; a list of captions gives its first); None when it holds neither. ValueError naming
    ``where`` when it is not a JSON object."""
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with text or caption, got {type(record).__name__}")
    caption = record.get("text", record.get("caption"))
    if isinstance(caption, list):
        caption = caption[0] if caption else None
    return caption.strip() if isinstance(caption, str) and caption.strip() else None


def read_captions(root: Path, files: list[Path]) -> dict[Path, str]:
    """Captions from ``root/metadata.jsonl`` (``file_name`` + ``text`` or ``caption``, the HF imagefolder
    convention), else from a ``<stem>.txt`` next to each file, else from a ``<stem>.json`` next to it
    (:func:`json_caption`). Files without a caption are left out."""
    captions: dict[Path, str] = {}
    meta = root / "metadata.jsonl"
    if meta.is_file():
        for n, line in enumerate(meta.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                captions[(root / rec["file_name"]).resolve()] = rec.get("text", rec.get("caption"))
            except (json.JSONDecodeError, KeyError) as err:
                raise ValueError(
                    f"{meta}:{n}: expected JSON with file_name and text/caption ({err})"
                ) from err
    for f in files:
        side, side_json = f.with_suffix(".txt"), f.with_suffix(".json")
        if f.resolve() in captions:
            continue
        if side.is_file():
            captions[f.resolve()] = side.read_text().strip()
        elif side_json.is_file():
            captions[f.resolve()] = json_caption(side_json.read_text(), str(side_json))
    return {f: captions[f.resolve()] for f in files if captions.get(f.resolve()) is not None}


class CaptionedImageFolder(_SkippingDataset):
    """Images with captions. Items: ``{"pixels": (3, H, W) in [-1, 1], "caption": str}`` (``buckets``:
    each image in the bucket nearest its aspect ratio)."""

    def __init__(self, root: str | Path, height: int, width: int, buckets=None):
        super().__init__(buckets)
        check_size("height", height)
        check_size("width", width)
        self.root = root = require_dir(root)
        files = sorted(p for p in root.rglob("*") if p.suffix in IMAGE_EXTENSIONS)
        self.captions = read_captions(root, files)
        self.paths = [f for f in files if f in self.captions]
        if not self.paths:
            raise FileNotFoundError(f"no captioned images under {str(root)!r} (metadata.jsonl, <name>.txt or "
                                    f"<name>.json)")
        self.height, self.width = height, width

    def load(self, index: int) -> dict:
        path = self.paths[index]
        with Image.open(path) as img:
            image = resize_center_crop(img.convert("RGB"), *self.size_for(*img.size))
        return {"pixels": to_tensor(image), "caption": self.captions[path]}
