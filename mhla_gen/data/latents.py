"""Latent caches on disk.

* :class:`LatentCacheDataset` — DiT class-conditional latents written by ``scripts/extract_latents.py``:
  ``latents.npy`` float16 ``(N, 2, C, h, w)`` (the image and its horizontal flip, so flips stay a
  training-time choice), ``labels.npy`` int64 ``(N,)``, ``meta.json``. The folder is written under a
  temporary name and renamed when complete, so a half-written cache is never read.
* :class:`FeatureCacheDataset` — SANA / Wan fine-tuning: one safetensors file per item with the VAE
  latents and the text encoder's embeddings, plus ``meta.json`` with a fingerprint of what made them
  (checkpoint, resolution, frames, text length); a different fingerprint rebuilds the cache.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .images import require_dir

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- DiT
@torch.no_grad()
def write_class_latents(
    dataset,
    encode: Callable[[torch.Tensor], torch.Tensor],
    out_dir: str | Path,
    meta: dict,
    batch_size: int = 64,
) -> Path:
    """Encode every readable image of a :class:`ClassFolderDataset` and its flip into ``out_dir``.

    ``encode``: pixels ``(B, 3, R, R)`` in [-1, 1] -> scaled latents ``(B, C, h, w)``. Unreadable images
    are skipped (logged, counted in ``meta["skipped"]``).
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    good, pixels, labels, skipped = [], [], [], 0
    latents = None

    def flush():
        nonlocal latents
        x = torch.stack(pixels)
        z = torch.stack([encode(x), encode(x.flip(-1))], dim=1).float().cpu().numpy().astype(np.float16)
        if latents is None:  # now the latent shape is known
            latents = np.lib.format.open_memmap(
                tmp / "latents.npy", "w+", np.float16, (len(dataset), *z.shape[1:])
            )
        latents[len(good) : len(good) + len(z)] = z
        good.extend(labels)
        pixels.clear()
        labels.clear()

    for i in range(len(dataset)):
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
        full = np.load(tmp / "latents.npy", mmap_mode="r")
        np.save(tmp / "latents_trim.npy", np.ascontiguousarray(full[:count]))
        del full
        os.replace(tmp / "latents_trim.npy", tmp / "latents.npy")
    np.save(tmp / "labels.npy", np.asarray(good, dtype=np.int64))
    (tmp / "meta.json").write_text(json.dumps({**meta, "count": count, "skipped": skipped}, indent=1))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    logger.info("wrote %d latents to %s (%d files skipped)", count, out_dir, skipped)
    return out_dir


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
    dataset, encode: Callable[[dict], dict[str, torch.Tensor]], cache_dir: str | Path, fingerprint: dict
) -> Path:
    """Encode each item of a captioned dataset once: ``cache_dir/items/<i>.safetensors``.

    Reuses the cache when ``meta.json`` holds the same fingerprint. Unreadable files are skipped
    (logged and counted in ``meta["skipped"]``).
    """
    from safetensors.torch import save_file

    cache_dir = Path(cache_dir)
    meta_path = cache_dir / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("fingerprint") == fingerprint:
        return cache_dir
    tmp = cache_dir.with_name(f".tmp-{cache_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "items").mkdir(parents=True)
    count, skipped = 0, 0
    for i in range(len(dataset)):
        try:
            item = dataset.load(i)
        except Exception as err:  # noqa: BLE001 - a bad file is a logged skip
            skipped += 1
            logger.warning("skipping unreadable file %s (%s: %s)", dataset.paths[i], type(err).__name__, err)
            continue
        with torch.no_grad():
            tensors = encode(item)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
            str(tmp / "items" / f"{count:08d}.safetensors"),
        )
        count += 1
    if count == 0:
        raise ValueError(f"no readable files among {len(dataset)} in the dataset")
    (tmp / "meta.json").write_text(
        json.dumps({"fingerprint": fingerprint, "count": count, "skipped": skipped}, indent=1)
    )
    shutil.rmtree(cache_dir, ignore_errors=True)
    os.replace(tmp, cache_dir)
    logger.info("cached %d items in %s (%d skipped)", count, cache_dir, skipped)
    return cache_dir


class FeatureCacheDataset(Dataset):
    """Items: the dict of tensors saved by :func:`build_feature_cache` for each item."""

    def __init__(self, cache_dir: str | Path):
        cache_dir = require_dir(cache_dir, "feature cache folder")
        self.meta = json.loads((cache_dir / "meta.json").read_text())
        self.files = [cache_dir / "items" / f"{i:08d}.safetensors" for i in range(self.meta["count"])]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict:
        from safetensors.torch import load_file

        return load_file(str(self.files[index]))
