"""Training data sampled from a teacher model, where the user has none (``data.source=teacher``; CLEAR's
teacher-generated training set).

``write_teacher_samples`` draws ``N`` class-conditional samples from a teacher through a ``generate``
function (the stock ``DiTPipeline`` in :class:`~mhla_gen.train.dit.DiTTask`) and writes them in the
latent-cache layout that :class:`~mhla_gen.data.LatentCacheDataset` reads: ``latents.npy`` float16
``(N, 2, C, h, w)`` (each sample and its horizontal flip), ``labels.npy``, ``meta.json``. Samples are drawn
in chunks, each saved under ``parts/`` as soon as it is done and with its own seed, so a killed run
continues where it stopped and gives the same data. The folder is a ``teacher_data`` folder of this
project (:mod:`mhla_gen.folders`): only such a folder, or an empty one, is written into; a folder built
with other settings (its ``meta.json`` fingerprint differs) is rebuilt.
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
from tqdm.auto import tqdm

from ..folders import claim

logger = logging.getLogger(__name__)

TEACHER_DATA = "teacher_data"  # the folder kind (mhla_gen.folders.KINDS)


def _fingerprint_matches(out: Path, fingerprint: dict) -> bool:
    meta = out / "meta.json"
    return meta.is_file() and json.loads(meta.read_text()).get("fingerprint") == fingerprint


def write_teacher_samples(
    generate: Callable[[list[int], int], torch.Tensor],
    out: str | Path,
    labels: list[int],
    fingerprint: dict,
    meta: dict,
    chunk: int = 64,
    setting: str = "data.path",
) -> Path:
    """Sample ``generate(labels, seed)`` -> ``(B, C, h, w)`` training-space tensors for every label, in
    chunks of ``chunk`` (chunk ``k`` uses seed ``k``), into ``out``; returns ``out``. Reuses a complete
    folder with the same ``fingerprint``; ``meta`` is recorded in ``meta.json`` (e.g. the VAE)."""
    out = claim(out, TEACHER_DATA, setting)
    if _fingerprint_matches(out, fingerprint) and (out / "latents.npy").is_file():
        return out
    if (out / "meta.json").is_file() or (out / "latents.npy").exists():
        logger.warning("%s=%s was sampled with other settings: sampling it again", setting, out)
        for name in ("latents.npy", "labels.npy", "meta.json", "parts"):
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    parts = out / "parts"
    parts.mkdir(exist_ok=True)
    (parts / "fingerprint.json").write_text(json.dumps(fingerprint))
    starts = list(range(0, len(labels), chunk))
    for k in tqdm(range(len(starts)), desc="sampling the teacher", unit="chunk"):
        part = parts / f"{k:05d}.npy"
        if part.is_file():
            continue
        x = generate(labels[starts[k] : starts[k] + chunk], k).float().cpu()  # (b, C, h, w)
        pair = torch.stack([x, x.flip(-1)], dim=1).numpy().astype(np.float16)  # (b, 2, C, h, w)
        tmp = parts / f".{k:05d}.tmp.npy"
        np.save(tmp, pair)
        os.replace(tmp, part)  # complete or absent: a killed run redoes only this chunk
    latents = np.concatenate([np.load(parts / f"{k:05d}.npy") for k in range(len(starts))])
    np.save(out / "latents.npy", latents)
    np.save(out / "labels.npy", np.asarray(labels, dtype=np.int64))
    record = {**meta, "fingerprint": fingerprint, "count": len(labels), "num_classes": max(labels) + 1}
    (out / "meta.json").write_text(json.dumps(record, indent=1))
    shutil.rmtree(parts)
    logger.info("sampled %d items from the teacher into %s", len(labels), out)
    return out


def read_prompts(path: str | Path, setting: str = "data.prompts_file") -> list[str]:
    """The non-empty lines of a prompt file; ``FileNotFoundError`` / ``ValueError`` naming ``setting``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{setting}={str(path)!r} does not exist")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{setting}={str(path)!r} holds no prompts")
    return prompts


def write_teacher_captioned(
    sample: Callable[[str, int], object],
    save: Callable[[object, Path], None],
    out: str | Path,
    prompts: list[str],
    count: int,
    suffix: str,
    fingerprint: dict,
    setting: str = "data.path",
) -> Path:
    """``count`` samples ``sample(prompt, seed=i)`` of the prompts in turn, written by ``save`` as
    ``out/<i:06d><suffix>`` with the prompt in ``<i:06d>.txt`` (the captioned-folder layout the SANA / Wan
    tasks read). Each sample is written under a temporary name and renamed when complete, so a killed run
    redoes only the missing ones; a folder sampled with other settings (``meta.json``) is sampled again."""
    out = claim(out, TEACHER_DATA, setting)
    meta = out / "meta.json"
    if meta.is_file() and json.loads(meta.read_text()).get("fingerprint") != fingerprint:
        logger.warning("%s=%s was sampled with other settings: sampling it again", setting, out)
        for path in out.glob("[0-9]*"):
            path.unlink()
    meta.write_text(json.dumps({"fingerprint": fingerprint, "count": count}, indent=1))
    for i in tqdm(range(count), desc="sampling the teacher", unit="sample"):
        target = out / f"{i:06d}{suffix}"
        if target.is_file():
            continue
        prompt = prompts[i % len(prompts)]
        (out / f"{i:06d}.txt").write_text(prompt)
        tmp = out / f".{i:06d}.tmp{suffix}"
        save(sample(prompt, i), tmp)
        os.replace(tmp, target)
    return out
