"""Training data sampled from a teacher model, where the user has none (``data.source=teacher``; CLEAR's
teacher-generated training set).

``write_teacher_samples`` draws ``N`` class-conditional samples from a teacher through a ``generate``
function (the stock ``DiTPipeline`` in :class:`~mhla_gen.train.dit.DiTTask`) and writes them in the
latent-cache layout that :class:`~mhla_gen.data.LatentCacheDataset` reads: ``latents.npy`` float16
``(N, 2, C, h, w)`` (each sample and its horizontal flip), ``labels.npy``, ``meta.json``. Samples are drawn
in chunks, each saved under ``parts/`` as soon as it is done and with its own seed, so a killed run
continues where it stopped and gives the same data. The folder is a ``teacher_data`` folder of this
project (:mod:`mhla_gen.outputs.folders`): only such a folder, or an empty one, is written into. Every file is
listed (name and size) as it is written; a folder built with other settings (its ``meta.json``
fingerprint differs) is rebuilt after deleting exactly the listed files, and a folder that also holds
files the user put there is refused at start-up (:func:`check_teacher_folder`): they would be read as
training data.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import ConfigError
from ..outputs.folders import (
    adopt_command,
    claim,
    content,
    listed,
    owned,
    record_files,
    remove_listed,
    unlisted,
)

logger = logging.getLogger(__name__)

TEACHER_DATA = "teacher_data"  # the folder kind (mhla_gen.outputs.folders.KINDS)


def _fingerprint_matches(out: Path, fingerprint: dict) -> bool:
    meta = out / "meta.json"
    return meta.is_file() and json.loads(meta.read_text()).get("fingerprint") == fingerprint


def check_teacher_folder(path: str | Path, setting: str = "data.path") -> None:
    """``path`` is new, empty or a teacher-data folder of ours holding only the files it listed
    (``ConfigError`` naming the first other file: the data set would read it, a rebuild would keep it)."""
    if owned(path, TEACHER_DATA, setting):
        if listed(path) is None and content(path):
            raise ConfigError(
                f"{setting}={str(path)!r} was sampled by an earlier mhla_gen that did not list its files; "
                f"nothing was changed: list them with: {adopt_command(TEACHER_DATA, path)}"
            )
        foreign = unlisted(path)
        if foreign:
            raise ConfigError(
                f"{setting}={str(path)!r} is a teacher-data folder of mhla_gen but also holds files it did "
                f"not write ({', '.join(foreign[:5])}); nothing was changed: move them out or choose "
                f"another {setting}"
            )


def _save_listed(out: Path, name: str, save: Callable[[Path], None]) -> None:
    """``save(tmp)`` then rename to ``out/name``, both names listed: a killed run leaves only listed files."""
    rel = Path(name)
    tmp = (rel.parent / f".{rel.name}.tmp{rel.suffix}").as_posix()
    record_files(out, tmp, pending=True)
    save(out / tmp)
    os.replace(out / tmp, out / name)
    record_files(out, name)


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
    check_teacher_folder(out, setting)
    out = claim(out, TEACHER_DATA, setting)
    if _fingerprint_matches(out, fingerprint) and (out / "latents.npy").is_file():
        return out
    parts_record = out / "parts" / "fingerprint.json"
    if (out / "meta.json").is_file() or (
        parts_record.is_file() and json.loads(parts_record.read_text()) != fingerprint
    ):
        logger.warning("%s=%s was sampled with other settings: sampling it again", setting, out)
        remove_listed(out, setting)
    (out / "parts").mkdir(exist_ok=True)
    _save_listed(out, "parts/fingerprint.json", lambda p: p.write_text(json.dumps(fingerprint)))
    starts = list(range(0, len(labels), chunk))
    for k in tqdm(range(len(starts)), desc="sampling the teacher", unit="chunk"):
        if (out / "parts" / f"{k:05d}.npy").is_file():
            continue
        x = generate(labels[starts[k] : starts[k] + chunk], k).float().cpu()  # (b, C, h, w)
        pair = torch.stack([x, x.flip(-1)], dim=1).numpy().astype(np.float16)  # (b, 2, C, h, w)
        # complete or absent: a killed run redoes only this chunk
        _save_listed(out, f"parts/{k:05d}.npy", lambda p, pair=pair: np.save(p, pair))
    latents = np.concatenate([np.load(out / "parts" / f"{k:05d}.npy") for k in range(len(starts))])
    _save_listed(out, "latents.npy", lambda p: np.save(p, latents))
    _save_listed(out, "labels.npy", lambda p: np.save(p, np.asarray(labels, dtype=np.int64)))
    record = {**meta, "fingerprint": fingerprint, "count": len(labels), "num_classes": max(labels) + 1}
    _save_listed(out, "meta.json", lambda p: p.write_text(json.dumps(record, indent=1)))
    for k in range(len(starts)):
        (out / "parts" / f"{k:05d}.npy").unlink()
    parts_record.unlink()
    (out / "parts").rmdir()  # empty now; a file of the user's there stops this (check_teacher_folder)
    logger.info("sampled %d items from the teacher into %s", len(labels), out)
    return out


def read_prompts(path: str | Path, setting: str = "data.prompts_file") -> list[str]:
    """The non-empty lines of a prompt file; ``FileNotFoundError`` / ``ConfigError`` naming ``setting`` (a
    file without prompts would otherwise give an empty sample set)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{setting}={str(path)!r} does not exist")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"{setting}={str(path)!r} holds no prompts (every line is blank)")
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
    check_teacher_folder(out, setting)
    out = claim(out, TEACHER_DATA, setting)
    meta = out / "meta.json"
    if meta.is_file() and json.loads(meta.read_text()).get("fingerprint") != fingerprint:
        logger.warning("%s=%s was sampled with other settings: sampling it again", setting, out)
        remove_listed(out, setting)  # exactly the files listed as written; nothing by pattern
    _save_listed(out, "meta.json", lambda p: p.write_text(json.dumps({"fingerprint": fingerprint,
                                                                        "count": count}, indent=1)))
    for i in tqdm(range(count), desc="sampling the teacher", unit="sample"):
        if (out / f"{i:06d}{suffix}").is_file():
            continue
        prompt = prompts[i % len(prompts)]
        _save_listed(out, f"{i:06d}.txt", lambda p, text=prompt: p.write_text(text))
        _save_listed(out, f"{i:06d}{suffix}", lambda p, text=prompt, i=i: save(sample(text, i), p))
    return out
