"""Latent caches on disk.

* :class:`LatentCacheDataset` — DiT class-conditional latents written by ``scripts/extract_latents.py``:
  ``latents.npy`` float16 ``(N, 2, C, h, w)`` (the image and its horizontal flip, so flips stay a
  training-time choice), ``labels.npy`` int64 ``(N,)``, ``meta.json``. The folder is written under a
  temporary name and renamed when complete, so a half-written cache is never read.
* :class:`FeatureCacheDataset` — SANA / Wan fine-tuning: one safetensors file per item with the VAE
  latents and the text encoder's embeddings, plus ``meta.json`` with a fingerprint of what made them
  (checkpoint, resolution, frames, text length); a different fingerprint rebuilds the cache.

Both caches are folders this project marks (:mod:`mhla_gen.outputs.folders`): a folder that is not empty and
not marked as a cache of the same kind is refused before anything is written, as is a cache folder that
is, contains or lies inside the data folder. Both are built in a marked temporary sibling (``.tmp-<name>``,
cleaned up if an interrupted run left one) and put in place when complete.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..outputs.folders import (
    check_apart,
    check_replaceable,
    check_temp,
    fresh_temp,
    record_files,
    replace_with,
)
from .images import require_dir

logger = logging.getLogger(__name__)

LATENT_CACHE = "latent_cache"  # folder kinds (mhla_gen.outputs.folders.KINDS)
FEATURE_CACHE = "feature_cache"


def check_cache_target(
    kind: str,
    cache_dir: str | Path,
    setting: str,
    inputs: dict[str, str | Path | None],
    inside_ok: tuple[str, ...] = (),
) -> None:
    """Refuse (``ConfigError`` naming ``setting``) a cache folder that is, contains or lies inside an input
    folder (inside is allowed for ``inside_ok``, e.g. the run's output_dir), that is not empty and not a
    ``kind`` cache of ours, or whose temporary sibling is a folder of the user's. Call it before any
    work; the writers call it again."""
    check_apart(cache_dir, setting, inputs, inside_ok)
    check_replaceable(cache_dir, kind, setting)
    check_temp(cache_dir, kind, setting)  # a leftover of ours is removed later, a user's folder refused


# ------------------------------------------------------------------------------------------- DiT
@torch.no_grad()
def write_class_latents(
    dataset,
    encode: Callable[[torch.Tensor], torch.Tensor],
    out_dir: str | Path,
    meta: dict,
    batch_size: int = 64,
    settings: tuple[str, str] = ("out_dir", "dataset root"),
) -> Path:
    """Encode every readable image of a :class:`ClassFolderDataset` and its flip into ``out_dir``.

    ``encode``: pixels ``(B, 3, R, R)`` in [-1, 1] -> scaled latents ``(B, C, h, w)``. Unreadable images
    are skipped (logged, counted in ``meta["skipped"]``). ``out_dir`` is replaced when complete; it must
    be new, empty or an earlier latent cache, and apart from the data (``settings`` name both in errors).
    """
    out_dir = Path(out_dir)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    check_cache_target(LATENT_CACHE, out_dir, settings[0], {settings[1]: dataset.root})
    tmp = fresh_temp(out_dir, LATENT_CACHE, settings[0])
    good, pixels, labels, skipped = [], [], [], 0
    latents = None

    def flush():
        nonlocal latents
        x = torch.stack(pixels)
        z = torch.stack([encode(x), encode(x.flip(-1))], dim=1).float().cpu().numpy().astype(np.float16)
        if latents is None:  # now the latent shape is known
            record_files(tmp, "latents.npy", "latents_trim.npy", "labels.npy", "meta.json", pending=True)
            latents = np.lib.format.open_memmap(
                tmp / "latents.npy", "w+", np.float16, (len(dataset), *z.shape[1:])
            )
        latents[len(good) : len(good) + len(z)] = z
        good.extend(labels)
        pixels.clear()
        labels.clear()

    for i in tqdm(range(len(dataset)), desc="encoding images", unit="img"):
        try:
            item = dataset.load(i)
        except Exception as err:  # noqa: BLE001 - a bad file is a logged skip
            skipped += 1
            logger.warning("skipping unreadable image %s (%s)", dataset.paths[i], err)
            continue
        pixels.append(item["pixels"])
        labels.append(int(item["class_labels"]))
        if len(pixels) == batch_size:
            flush()
    if pixels:
        flush()
    if not good:
        raise ValueError(f"no readable images in {len(dataset)} files")
    count = len(good)
    latents.flush()
    del latents
    if count < len(dataset):  # drop the unused tail rows left by skipped files
        _trim(tmp / "latents.npy", count)
    np.save(tmp / "labels.npy", np.asarray(good, dtype=np.int64))
    (tmp / "meta.json").write_text(json.dumps({**meta, "count": count, "skipped": skipped}, indent=1))
    replace_with(tmp, out_dir, LATENT_CACHE, settings[0])
    logger.info("wrote %d latents to %s (%d files skipped)", count, out_dir, skipped)
    return out_dir


def _trim(path: Path, count: int) -> None:
    """Keep the first ``count`` rows of the ``.npy`` at ``path`` (written beside it, then renamed)."""
    full = np.load(path, mmap_mode="r")
    np.save(path.with_name("latents_trim.npy"), np.ascontiguousarray(full[:count]))
    del full
    os.replace(path.with_name("latents_trim.npy"), path)


class LatentCacheDataset(Dataset):
    """Items: ``{"latents": (2, C, h, w) float32 [image, flipped image], "class_labels": long}``."""

    def __init__(self, root: str | Path):
        root = require_dir(root, "latent cache folder")
        if not (root / "meta.json").is_file():
            raise FileNotFoundError(
                f"{root} has no meta.json: not a latent cache from scripts/extract_latents.py"
            )
        self.meta = json.loads((root / "meta.json").read_text())
        self.latents = np.load(root / "latents.npy", mmap_mode="r")
        self.labels = np.load(root / "labels.npy")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {
            "latents": torch.from_numpy(np.array(self.latents[index], dtype=np.float32)),
            "class_labels": torch.tensor(int(self.labels[index])),
        }


# ---------------------------------------------------------------------------------- SANA and Wan
def build_feature_cache(
    dataset,
    encode: Callable[[dict], dict[str, torch.Tensor]],
    cache_dir: str | Path,
    fingerprint: dict,
    setting: str = "cache_dir",
    inputs: dict[str, str | Path | None] | None = None,
    inside_ok: tuple[str, ...] = (),
) -> Path:
    """Encode each item of a captioned dataset once: ``cache_dir/items/<i>.safetensors``.

    Reuses the cache when ``meta.json`` holds the same fingerprint, otherwise rebuilds it in a temporary
    sibling and replaces ``cache_dir``, which must be new, empty or a feature cache, and apart from
    ``inputs`` (setting -> folder; default: the dataset's root). Unreadable files are skipped (logged and
    counted in ``meta["skipped"]``).
    """
    from safetensors.torch import save_file

    cache_dir = Path(cache_dir)
    inputs = {"data.path": getattr(dataset, "root", None)} if inputs is None else inputs
    check_cache_target(FEATURE_CACHE, cache_dir, setting, inputs, inside_ok)
    meta_path = cache_dir / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("fingerprint") == fingerprint:
        return cache_dir
    tmp = fresh_temp(cache_dir, FEATURE_CACHE, setting)
    (tmp / "items").mkdir()
    count, skipped, shapes = 0, 0, []
    for i in tqdm(range(len(dataset)), desc="caching latents + text embeddings", unit="item"):
        try:
            item = dataset.load(i)
        except Exception as err:  # noqa: BLE001 - a bad file is a logged skip
            skipped += 1
            logger.warning("skipping unreadable file %s (%s: %s)", dataset.paths[i], type(err).__name__, err)
            continue
        with torch.no_grad():
            tensors = encode(item)
        shapes.append(list(tensors["latents"].shape) if "latents" in tensors else None)
        record_files(tmp, f"items/{count:08d}.safetensors", pending=True)  # an interrupted build stays listed
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
            str(tmp / "items" / f"{count:08d}.safetensors"),
        )
        count += 1
    if count == 0:
        raise ValueError(f"no readable files among {len(dataset)} in the dataset")
    record_files(tmp, "meta.json", pending=True)
    (tmp / "meta.json").write_text(
        json.dumps({"fingerprint": fingerprint, "count": count, "skipped": skipped, "shapes": shapes})
    )
    replace_with(tmp, cache_dir, FEATURE_CACHE, setting)
    logger.info("cached %d items in %s (%d skipped)", count, cache_dir, skipped)
    return cache_dir


class FeatureCacheDataset(Dataset):
    """Items: the dict of tensors saved by :func:`build_feature_cache` for each item. ``shapes``: each
    item's latent shape (what aspect-ratio buckets group by; None for a cache written before it was
    recorded)."""

    def __init__(self, cache_dir: str | Path):
        cache_dir = require_dir(cache_dir, "feature cache folder")
        self.meta = json.loads((cache_dir / "meta.json").read_text())
        self.files = [cache_dir / "items" / f"{i:08d}.safetensors" for i in range(self.meta["count"])]
        shapes = self.meta.get("shapes")
        self.shapes = [tuple(s) for s in shapes] if shapes and None not in shapes else None

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict:
        from safetensors.torch import load_file

        return load_file(str(self.files[index]))
