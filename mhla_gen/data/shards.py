"""Captioned images / videos in webdataset-style tar shards (``data.source=shards``).

``data.path`` is a folder of shards (``.tar``, or gzip-compressed ``.tar.gz`` / ``.tgz``; searched
recursively, sorted) or a glob such as ``/data/shards/train-*.tar``. Inside a shard, files sharing a key (the
member path up to the first dot of its name: ``000123.jpg`` + ``000123.txt``) form one item: an image
(``.jpg`` ``.jpeg`` ``.png`` ``.webp`` ``.bmp``) or a video (``.mp4`` ``.webm`` ``.mkv`` ``.mov`` ``.avi``
``.gif``) with its caption (``.txt`` or ``.caption``, else the ``text`` / ``caption`` of a ``.json``). Keys
without a caption or without media are left out (counted in a warning); no item at all is a start-up error
naming ``data.path``.

Why Python's ``tarfile`` and not the ``webdataset`` package: webdataset streams shards as an
``IterableDataset``, while the training loop needs a map-style dataset (a length, Accelerate's seeded
sampler and ``skip_first_batches``) for its exact resume. The shards are indexed once at start-up (member
offsets and captions, reading tar headers and the small caption files) and each item is read with one
seek into its shard. A gzip-compressed shard (told by its first bytes, whatever its name) is indexed the
same way through Python's ``gzip`` (offsets in the decompressed stream) and read through one open
``GzipFile`` per process, which seeks forward by decompressing: the feature cache reads items in order, so
each shard is decompressed about once (backward seeks restart from the shard's start). Other compressions
(bz2, xz, zstd) are refused: decompress them, or recompress with gzip.
"""

from __future__ import annotations

import glob
import gzip
import io
import logging
import os
import tarfile
from pathlib import Path

from PIL import Image

from ..errors import ConfigError
from .images import (
    IMAGE_EXTENSIONS,
    _SkippingDataset,
    check_size,
    json_caption,
    resize_center_crop,
    to_tensor,
)
from .videos import VIDEO_EXTENSIONS, FrameSampling, frames_to_tensor, read_frames

logger = logging.getLogger(__name__)

CAPTION_EXTENSIONS = (".txt", ".caption")
JSON_EXTENSION = ".json"  # a caption in its text / caption field, used where no .txt / .caption is
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
GZIP_MAGIC = b"\x1f\x8b"


def input_folder(source: str) -> str:
    """The folder a ``data.path`` reads from (what outputs must stay apart from): a glob's fixed part."""
    parts = Path(source).expanduser().parts
    fixed = [p for p in parts[: next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), None)]]
    return str(Path(*fixed)) if fixed else "."


def list_shards(source: str, setting: str = "data.path") -> list[Path]:
    """The shards (:data:`SHARD_SUFFIXES`) of a folder (recursive) or a glob, sorted; FileNotFoundError
    when none."""
    if any(c in source for c in "*?["):
        found = glob.glob(str(Path(source).expanduser()))
        shards = sorted(Path(p) for p in found if p.endswith(SHARD_SUFFIXES))
    else:
        root = Path(source).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"{setting} {source!r} is neither a folder of .tar shards nor a glob")
        shards = sorted(p for p in root.rglob("*") if p.name.endswith(SHARD_SUFFIXES)
                        and not p.name.startswith(".") and p.is_file())
    if not shards:
        raise FileNotFoundError(f"no .tar shards (nor .tar.gz / .tgz) in {setting}={source!r}")
    return shards


def is_gzipped(shard: Path) -> bool:
    """The shard starts with gzip's magic bytes (its name does not decide)."""
    with open(shard, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def _split(name: str) -> tuple[str, str]:
    """webdataset's key rule: ``dir/000123.seg.jpg`` -> (``dir/000123``, ``.seg.jpg``)."""
    folder, _, base = name.rpartition("/")
    stem, dot, extension = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (dot + extension).lower()


def index_shard(shard: Path, media_extensions: tuple[str, ...]) -> tuple[list[tuple], int]:
    """``([(offset, size, member name, caption)], keys left out)`` of one shard, plain or gzip-compressed
    (offsets into the decompressed tar)."""
    media, captions, json_captions = {}, {}, {}
    try:
        with tarfile.open(shard, "r:gz" if is_gzipped(shard) else "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = _split(member.name)
                if ext in media_extensions:
                    media[key] = (member.offset_data, member.size, member.name)
                elif ext in CAPTION_EXTENSIONS:
                    captions[key] = tar.extractfile(member).read().decode("utf-8").strip()
                elif ext == JSON_EXTENSION:
                    raw = tar.extractfile(member).read()
                    json_captions[key] = json_caption(raw, f"data.path: {shard}#{member.name}")
    except (tarfile.TarError, OSError, EOFError) as err:
        raise ConfigError(f"data.path: {shard} is not a readable tar shard ({type(err).__name__}: {err}); "
                          f"shards are .tar, or gzip-compressed .tar.gz / .tgz (decompress other "
                          f"compressions, or recompress them with gzip)") from None
    captions = {**{k: c for k, c in json_captions.items() if c}, **{k: c for k, c in captions.items() if c}}
    items = [(*media[k], captions[k]) for k in sorted(media) if captions.get(k)]
    return items, len(set(media) | set(captions) | set(json_captions)) - len(items)


class TarShardDataset(_SkippingDataset):
    """Captioned images (``video=False``) or videos from tar shards. Items: ``{"pixels": (3, H, W) or
    (3, F, H, W) in [-1, 1], "caption": str}``. ``paths``: ``<shard>#<member>`` (the feature cache key).
    ``frames``: which frames of a video; ``buckets``: as for folders."""

    def __init__(self, source: str, height: int, width: int, num_frames: int | None = None,
                 frames: FrameSampling | None = None, buckets=None):
        super().__init__(buckets)
        self.frames = frames or FrameSampling()
        self._open = None  # (pid, shard, GzipFile): the compressed shard this process reads now
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
        self.gzipped = {shard: is_gzipped(shard) for shard in {item[0] for item in self.index}}
        self.height, self.width, self.num_frames = height, width, num_frames

    def read(self, index: int) -> bytes:
        shard, offset, size, _, _ = self.index[index]
        if self.gzipped[shard]:
            f = self._gzip_file(shard)
            f.seek(offset)  # forward: decompresses from where the last item ended
            return f.read(size)
        with open(shard, "rb") as f:  # opened per item: safe in forked DataLoader workers
            f.seek(offset)
            return f.read(size)

    def _gzip_file(self, shard: Path) -> gzip.GzipFile:
        """This process's open ``GzipFile`` of ``shard`` (a forked worker opens its own)."""
        pid = os.getpid()
        if self._open is None or self._open[:2] != (pid, shard):
            if self._open is not None and self._open[0] == pid:
                self._open[2].close()
            self._open = (pid, shard, gzip.open(shard, "rb"))
        return self._open[2]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": None}  # an open file does not travel to spawned workers

    def load(self, index: int) -> dict:
        data, caption = io.BytesIO(self.read(index)), self.index[index][4]
        if self.video:
            frames = read_frames(data, self.num_frames, self.frames, key=self.paths[index])
            pixels = frames_to_tensor(frames, *self.size_for(*frames[0].size))
        else:
            with Image.open(data) as img:
                pixels = to_tensor(resize_center_crop(img.convert("RGB"), *self.size_for(*img.size)))
        return {"pixels": pixels, "caption": caption}
