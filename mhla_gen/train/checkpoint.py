"""Atomic Accelerate checkpoints: ``output_dir/checkpoints/checkpoint_<step>``.

Why not ``ProjectConfiguration(automatic_checkpoint_naming=True)``: Accelerate then writes straight into
``checkpoints/checkpoint_<save count>``, so a job killed halfway through a save leaves a half-written
folder that looks like the newest checkpoint, and the folder number counts saves, not optimizer steps.
Here ``accelerator.save_state`` writes into ``checkpoints/.tmp-checkpoint_<step>``; the main process adds
``trainer_state.json`` (step + model signature) and only then renames the folder into place with
``os.replace`` (atomic on POSIX). Resume only ever sees complete checkpoints; leftover ``.tmp-*`` folders
are deleted. ``train.checkpoints_total_limit`` keeps the newest N, pruned after the new one is in place.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint_(\d+)$")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_step(path: str | Path) -> int:
    """The step in a ``checkpoint_<step>`` folder name."""
    match = _NAME.match(Path(path).name)
    if match is None:
        raise ValueError(f"{str(path)!r} is not named checkpoint_<step>")
    return int(match.group(1))


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """``latest`` -> newest complete checkpoint in output_dir (or None), ``none`` -> None, else a PATH."""
    if resume in ("none", "", None):
        return None
    if resume == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume={resume!r} is not a complete checkpoint folder (no {STATE_FILE})")
    return path


def read_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def check_signature(checkpoint: Path, signature: dict) -> None:
    """Raise ValueError naming every model/MHLA setting on which the checkpoint and the config disagree."""
    saved = read_state(checkpoint).get("signature", {})
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r} vs config {signature.get(k)!r}"
        for k in sorted(set(saved) | set(signature))
        if saved.get(k) != signature.get(k)
    ]
    if diffs:
        raise ValueError(f"checkpoint {checkpoint} does not match the config:\n  " + "\n  ".join(diffs))


def remove_partial(output_dir: str | Path) -> None:
    """Delete ``.tmp-*`` folders left by a job killed during a save (main process only)."""
    root = checkpoint_root(output_dir)
    if root.is_dir():
        for p in root.glob(".tmp-*"):
            logger.warning("removing incomplete checkpoint %s", p)
            shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(
    accelerator, output_dir: str | Path, step: int, signature: dict, total_limit: int, before_commit=None
) -> Path:
    """``accelerator.save_state`` into a temp folder, then rename it to ``checkpoint_<step>`` atomically.

    ``before_commit`` (main process) runs after the state is written and before the rename (:func:`train`
    calls its callbacks' ``on_checkpoint_staged`` there).
    """
    root = checkpoint_root(output_dir)
    tmp = root / f".tmp-checkpoint_{step}"
    final = root / f"checkpoint_{step}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # models, optimizer, scheduler, RNG states, registered objects (EMA)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, "signature": signature}, indent=1))
        if before_commit is not None:
            before_commit()
        if final.exists():  # same step saved again (e.g. a resumed run re-saving); replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        logger.info("saved %s", final)
        for old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final
