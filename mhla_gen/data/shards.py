"""Captioned images / videos in webdataset-style tar shards (``data.source=shards``).

``data.path`` is a folder of ``.tar`` files (searched recursively, sorted) or a glob such as
``/data/shards/train-*.tar``. Inside a shard, files sharing a key (the member path up to the first dot of
its name: ``000123.jpg`` + ``000123.txt``) form one item: an image (``.jpg`` ``.jpeg`` ``.png`` ``.webp``
``.bmp``) or a video (``.mp4`` ``.webm`` ``.mkv`` ``.mov`` ``.avi`` ``.gif``) with its caption (``.txt``, or
``.caption``). Keys without a caption or without media are left out (counted in a warning); no item at all
is a start-up error naming ``data.path``.

Why Python's ``tarfile`` and not the ``webdataset`` package: webdataset streams shards as an
``IterableDataset``, while the training loop needs a map-style dataset (a length, Accelerate's seeded
sampler and ``skip_first_batches``) for its exact resume. The shards are indexed once at start-up (member
offsets and captions, reading tar headers and the small caption files) and each item is read with one
seek into its uncompressed shard; compressed shards (``.tar.gz``) cannot be read that way and are refused.
"""

from __future__ import annotations

import glob
import io
import logging
import tarfile
from pathlib import Path

from PIL import Image

from ..errors import ConfigError
from .images import IMAGE_EXTENSIONS, _SkippingDataset, check_size, resize_center_crop, to_tensor
from .videos import VIDEO_EXTENSIONS, frames_to_tensor, read_frames

logger = logging.getLogger(__name__)

CAPTION_EXTENSIONS = (".txt", ".caption")


def input_folder(source: str) -> str:
    """The folder a ``data.path`` reads from (what outputs must stay apart from): a glob's fixed part."""
    parts = Path(source).expanduser().parts
    fixed = [p for p in parts[: next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), None)]]
    return str(Path(*fixed)) if fixed else "."


def list_shards(source: str, setting: str = "data.path") -> list[Path]:
    """The ``.tar`` shards of a folder (recursive) or a glob, sorted; FileNotFoundError when none."""
    if any(c in source for c in "*?["):
        shards = sorted(Path(p) for p in glob.glob(str(Path(source).expanduser())) if p.endswith(".tar"))
    else:
        root = Path(source).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"{setting} {source!r} is neither a folder of .tar shards nor a glob")
        shards = sorted(p for p in root.rglob("*.tar") if not p.name.startswith("."))
    if not shards:
        raise FileNotFoundError(f"no .tar shards in {setting}={source!r}")
    return shards


def _split(name: str) -> tuple[str, str]:
    """webdataset's key rule: ``dir/000123.seg.jpg`` -> (``dir/000123``, ``.seg.jpg``)."""
    folder, _, base = name.rpartition("/")
    stem, dot, extension = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (dot + extension).lower()


def index_shard(shard: Path, media_extensions: tuple[str, ...]) -> tuple[list[tuple], int]:
    """``([(offset, size, member name, caption)], keys left out)`` of one uncompressed shard."""
    media, captions = {}, {}
    try:
        with tarfile.open(shard, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = _split(member.name)
                if ext in media_extensions:
                    media[key] = (member.offset_data, member.size, member.name)
                elif ext in CAPTION_EXTENSIONS:
                    captions[key] = tar.extractfile(member).read().decode("utf-8").strip()
    except tarfile.ReadError as err:
        raise ConfigError(f"data.path: {shard} is not an uncompressed tar shard ({err}); compressed shards "
                          f"cannot be read item by item") from None
    items = [(*media[k], captions[k]) for k in sorted(media) if captions.get(k)]
    return items, len(set(media) | set(captions)) - len(items)


class TarShardDataset(_SkippingDataset):
    """Captioned images (``video=False``) or videos from tar shards. Items: ``{"pixels": (3, H, W) or
    (3, F, H, W) in [-1, 1], "caption": str}``. ``paths``: ``<shard>#<member>`` (the feature cache key)."""

    def __init__(self, source: str, height: int, width: int, num_frames: int | None = None):
        super().__init__()
        check_size("height", height)
        check_size("width", width)
        self.video = num_frames is not None
        extensions = tuple(e.lower() for e in (VIDEO_EXTENSIONS if self.video else IMAGE_EXTENSIONS))
        self.index, left_out = [], 0
        for shard in list_shards(source):
            items, skipped = index_shard(shard, extensions)
            self.index += [(shard, *item) for item in items]
            left_out += skipped
        if left_out:
            logger.warning("data.path=%s: %d keys without both %s and a caption left out", source, left_out,
                           "a video" if self.video else "an image")
        if not self.index:
            kind = "videos" if self.video else "images"
            raise FileNotFoundError(f"no captioned {kind} (key{extensions[0]} + key.txt) in the shards of "
                                    f"data.path={source!r}")
        self.paths = [f"{shard}#{name}" for shard, _, _, name, _ in self.index]
        self.height, self.width, self.num_frames = height, width, num_frames

    def read(self, index: int) -> bytes:
        shard, offset, size, _, _ = self.index[index]
        with open(shard, "rb") as f:  # opened per item: safe in forked DataLoader workers
            f.seek(offset)
            return f.read(size)

    def load(self, index: int) -> dict:
        data, caption = io.BytesIO(self.read(index)), self.index[index][4]
        if self.video:
            pixels = frames_to_tensor(read_frames(data, self.num_frames), self.height, self.width)
        else:
            with Image.open(data) as img:
                pixels = to_tensor(resize_center_crop(img.convert("RGB"), self.height, self.width))
        return {"pixels": pixels, "caption": caption}
