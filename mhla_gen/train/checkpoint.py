"""Atomic Accelerate checkpoints: ``output_dir/checkpoints/checkpoint_<step>``.

Why not ``ProjectConfiguration(automatic_checkpoint_naming=True)``: Accelerate then writes straight into
``checkpoints/checkpoint_<save count>``, so a job killed halfway through a save leaves a half-written
folder that looks like the newest checkpoint, and the folder number counts saves, not optimizer steps.
Here ``accelerator.save_state`` writes into a marked temporary folder ``checkpoints/.tmp-checkpoint_<step>``
(:func:`mhla_gen.outputs.folders.fresh_temp`); the main process adds ``trainer_state.json`` (step + model
signature), lists every file in the folder's marker (:func:`outputs.folders.seal`) and only then renames
the folder into place with ``os.replace`` (atomic on POSIX). Resume only ever sees complete checkpoints.

Nothing is deleted by name or pattern (:mod:`mhla_gen.outputs.folders`): a leftover temporary folder and a
checkpoint pruned by ``train.checkpoints_total_limit`` (the newest N are kept, pruned after the new one is
in place) are deleted only when marked as ours and holding exactly what their listing names
(:func:`outputs.folders.discard`). A checkpoint holding a file of the user's, or written by an earlier
version (no listing: ``mhla-gen adopt checkpoint FOLDER`` lists it), is left untouched with a
warning. The main process does all of this; the other ranks wait and write into the folder it chose.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from ..errors import ConfigError
from ..outputs.folders import (
    adopt_command,
    discard,
    fresh_temp,
    listed,
    read_marker,
    seal,
    strays,
    torch_archive_cut,
)

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
KIND = "checkpoint"  # the folder kind of a checkpoint and of its temporary folder (outputs.folders.KINDS)
SETTING = "output_dir (its checkpoints/)"
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
    path = Path(resume).expanduser()  # as output_dir: a config file's ~ reaches here unexpanded
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume={resume!r} is not a complete checkpoint folder (no {STATE_FILE})")
    return path


def read_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def check_intact(checkpoint: Path, setting: str) -> None:
    """``ConfigError`` naming the first damaged file of ``checkpoint`` (before the run writes anything):
    a file its listing names that is missing or has another size than when it was saved, a
    ``trainer_state.json`` that does not parse, a ``torch.save`` archive cut short (a checkpoint adopted
    or listed as it was), a ``.safetensors`` file whose header does not read.
    Nothing is changed: the user decides whether to move the checkpoint away."""
    from safetensors import safe_open

    checkpoint = Path(checkpoint)
    fix = (f"nothing was changed: move {str(checkpoint)!r} away to resume from the checkpoint before it, "
           f"or choose another output_dir")

    def damaged(name: str, what: str) -> ConfigError:
        return ConfigError(f"{setting}: checkpoint file {str(checkpoint / name)!r} {what}; {fix}")

    for name, size in sorted((listed(checkpoint) or {}).items()):
        path = checkpoint / name
        if not path.is_file():
            raise damaged(name, "is missing")
        if size is not None and path.stat().st_size != size:
            raise damaged(name, f"has {path.stat().st_size} bytes, {size} when it was saved (truncated or "
                                "changed)")
    try:
        state = read_state(checkpoint)
    except (OSError, ValueError) as err:
        raise damaged(STATE_FILE, f"does not read ({err})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise damaged(STATE_FILE, "holds no step")
    archives = [p for p in checkpoint.rglob("*") if p.suffix in (".bin", ".pkl", ".pt") and p.is_file()]
    for path in sorted(archives):
        if torch_archive_cut(path):
            raise damaged(str(path.relative_to(checkpoint)), "is cut short (its zip directory is missing)")
    for path in sorted(checkpoint.rglob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error type (not an OSError)
            raise damaged(str(path.relative_to(checkpoint)), f"does not read ({err})") from None


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


# settings whose state a checkpoint holds and a resume cannot change: which parameters train (the optimizer
# state is theirs), the optimizer (its state layout) and the EMA (diffusers' EMAModel.load_state_dict takes
# the saved decay over the configured one, so a changed decay would be ignored without a word)
TRAINING_SETTINGS = ("train.trainable", "train.optimizer", "train.ema_decay")


def training_record(cfg) -> dict:
    """``{setting: value}`` of :data:`TRAINING_SETTINGS` in the run config ``cfg`` (saved with each
    checkpoint)."""
    return {setting: getattr(cfg.train, setting.split(".")[1]) for setting in TRAINING_SETTINGS}


def _recorded_training(checkpoint: Path) -> dict:
    """What :func:`training_record` saved with ``checkpoint``; for a checkpoint saved before that record,
    the values of its run's ``config.yaml`` (``output_dir/checkpoints/checkpoint_N``) when that file is
    not newer than the checkpoint, else nothing. Every start rewrites ``config.yaml``, also one of an
    earlier version that then failed before its first checkpoint, e.g. while loading this checkpoint's
    optimizer state with another ``train.optimizer``: its values are not the checkpoint's."""
    saved = read_state(checkpoint).get("training")
    if isinstance(saved, dict):
        return saved
    record = Path(checkpoint).parent.parent / "config.yaml"
    if not record.is_file() or record.stat().st_mtime_ns > (Path(checkpoint) / STATE_FILE).stat().st_mtime_ns:
        return {}
    from omegaconf import OmegaConf

    recorded = OmegaConf.load(record)
    values = {setting: OmegaConf.select(recorded, setting) for setting in TRAINING_SETTINGS}
    return {setting: value for setting, value in values.items() if value is not None}


def check_training(checkpoint: Path, cfg) -> None:
    """``ConfigError`` listing every :data:`TRAINING_SETTINGS` entry the run gives otherwise than the
    checkpoint it resumes was saved with (before anything is written)."""
    saved, now = _recorded_training(checkpoint), training_record(cfg)
    diffs = [f"{k}={now[k]!r} (the checkpoint's: {saved[k]!r})" for k in TRAINING_SETTINGS
             if k in saved and saved[k] != now[k]]
    if diffs:
        raise ConfigError(
            f"resume={cfg.resume}: {', '.join(diffs)}: checkpoint {str(checkpoint)!r} holds the optimizer "
            f"and EMA state of its own settings; nothing was changed: give the checkpoint's values, or start "
            f"anew in another output_dir (model.init_from=<a saved final/> to start from its weights)"
        )


def remove_partial(output_dir: str | Path) -> None:
    """Main process, at start-up: delete the temporary folders of saves killed halfway (marked as our
    checkpoints, not named ``checkpoint_<step>``) that hold exactly what they list; others stay, with a
    warning (:func:`outputs.folders.discard`)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if path.is_dir() and not path.is_symlink() and not _NAME.match(path.name):
            if (read_marker(path) or {}).get("kind") == KIND and discard(path, KIND, SETTING):
                logger.warning("removed incomplete checkpoint %s", path)


def _check_replaceable(final: Path) -> None:
    """``ConfigError`` (before this save writes anything) when ``final`` exists and could not be replaced."""
    if final.exists() and ((read_marker(final) or {}).get("kind") != KIND or strays(final)):
        raise ConfigError(
            f"{SETTING}: {str(final)!r} exists and holds what mhla_gen did not list as its own ("
            f"{', '.join(strays(final)[:5]) or 'no marker'}); nothing of it was changed: move it away. If "
            f"an earlier mhla_gen wrote it, list it with: {adopt_command(KIND, final)}"
        )


def _shared_path(accelerator, path: Path | None) -> Path:
    """The main process's ``path`` on every process (the folder all ranks save into)."""
    from accelerate.utils import broadcast_object_list

    return Path(broadcast_object_list([str(path) if path is not None else None], from_process=0)[0])


def save_checkpoint(
    accelerator, output_dir: str | Path, step: int, signature: dict, total_limit: int, before_commit=None,
    training: dict | None = None,
) -> Path:
    """``accelerator.save_state`` into a marked temp folder, list its files, then rename it to
    ``checkpoint_<step>`` atomically and prune the old checkpoints that are ours (module docstring).

    ``before_commit`` (main process) runs after the state is written and listed and before the rename
    (:func:`train` calls its callbacks' ``on_checkpoint_staged`` there). ``training``: the run's
    :func:`training_record`, saved beside the step and the signature.
    """
    root = checkpoint_root(output_dir)
    final = root / f"checkpoint_{step}"
    tmp = None
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        _check_replaceable(final)  # same step saved again (e.g. a resumed run re-saving)
        try:
            tmp = fresh_temp(final, KIND, SETTING, lock=False)  # the run folder's lock covers it
        except ConfigError as err:  # .tmp-checkpoint_<step> is not ours (e.g. an earlier version's): kept
            logger.warning("%s; building beside it", err)
            tmp = fresh_temp(final.with_name(f"{final.name}-{os.getpid()}"), KIND, SETTING, lock=False)
    tmp = _shared_path(accelerator, tmp) if accelerator.num_processes > 1 else tmp
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # models, optimizer, scheduler, RNG states, registered objects (EMA)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {"step": step, "signature": signature, **({"training": training} if training else {})}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        seal(tmp)  # every file listed: a save killed from here on is removable as a whole
        if before_commit is not None:
            before_commit()
        if final.exists() and not discard(final, KIND, SETTING):
            raise ConfigError(f"{SETTING}: {str(final)!r} could not be replaced (see the warning above); the "
                              f"new checkpoint is kept in {str(tmp)!r}")
        os.replace(tmp, final)
        logger.info("saved %s", final)
        for old in list_checkpoints(output_dir)[:-total_limit]:
            discard(old, KIND, SETTING)  # ours and only what it lists: deleted; otherwise kept and said
    accelerator.wait_for_everyone()
    return final
