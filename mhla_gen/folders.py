"""Which files and folders are this project's, and the one rule every writer follows.

**A folder is ours only if we marked it.** A folder that mhla_gen creates (a training run's
``output_dir``, a latent or feature cache, a sample set, a model folder, a temporary ``.tmp-<name>``)
gets a marker file, ``.mhla_gen.json``, naming its *kind*. Names prove nothing: a user's
``config.yaml``, ``meta.json``, ``metrics.jsonl`` or ``000000.png`` look exactly like ours. So

* an absent or empty folder may be created / used (and is marked);
* a folder marked with the same kind is ours: its files may be written and replaced;
* a non-empty unmarked folder, a folder marked with another kind, or a file where a folder should be
  is refused with a :class:`ConfigError` naming the setting, before any work. A folder that an earlier
  mhla_gen (before markers) wrote can be adopted explicitly: ``python -m mhla_gen.adopt KIND FOLDER``.

A folder that is replaced *wholesale* (a cache rebuilt in a temporary sibling, a model folder) must in
addition hold only entries a folder of its kind holds (:data:`KINDS`), so that a user's file put inside
one of our folders is never deleted with it.

**A single file is ours only if it carries our record**: JSON files written by the eval scripts hold
``{"mhla_gen": {"kind": ...}}`` and ``.npz`` files an array ``mhla_gen_kind`` (a record inside the file
rather than a sidecar file beside it, so that it cannot be separated from the file it describes). An
existing file without it is replaced only when the user says ``--overwrite``.

:func:`check_apart` refuses an output that is, contains or lies inside an input (``--out`` = ``--data``
would otherwise replace the data).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
from pathlib import Path

from .errors import ConfigError

logger = logging.getLogger(__name__)

MARKER = ".mhla_gen.json"
FILE_RECORD = "mhla_gen"  # key of the record in a JSON file; .npz: FILE_RECORD + "_kind"

# kind -> what it is, and the entries (fnmatch patterns) a folder of that kind holds
KINDS: dict[str, tuple[str, frozenset[str]]] = {
    "run": (
        "training run (output_dir)",
        frozenset({"config.yaml", "metrics.jsonl", "checkpoints", "logs", "samples", "final", "cache",
                   "attention_stats", ".tmp-*", ".config.yaml.*", ".metrics.jsonl.*"}),
    ),
    "latent_cache": (
        "DiT latent cache", frozenset({"latents.npy", "labels.npy", "meta.json", "latents_trim.npy"})
    ),
    "feature_cache": ("SANA / Wan feature cache", frozenset({"items", "meta.json"})),
    "teacher_data": (
        "teacher-sampled training data",
        frozenset({"latents.npy", "labels.npy", "meta.json", "parts", "[0-9]*.png", "[0-9]*.mp4",
                   "[0-9]*.txt", ".[0-9]*.tmp.*"}),
    ),
    "samples": (
        "evaluation sample set (eval/generate.py)",
        frozenset({"config.yaml", "manifest.jsonl", "manifest.*.jsonl", "samples.npz",
                   "[0-9][0-9][0-9][0-9][0-9][0-9].png", "[0-9][0-9][0-9][0-9][0-9][0-9].mp4",
                   ".[0-9]*.tmp.png", ".[0-9]*.tmp.mp4", "metrics_*.json"}),
    ),
    "sample_outputs": ("scripts/sample.py output", frozenset({"*.png", "*.mp4"})),
    "model": (
        "transformer folder (save_pretrained)",
        frozenset({"config.json", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
                   "mhla_lora.json"}),
    ),
    "attention_stats": ("attention statistics", frozenset({"attention_stats.json", "attention_stats.png"})),
    "study": ("study (eval/study.py)", frozenset({"*"})),
    "diffusers_tests": ("diffusers test export (scripts/diffusers_model_tests.py)", frozenset({"*"})),
}


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


def check_apart(
    out: str | Path, out_setting: str, inputs: dict[str, str | Path | None], inside_ok: tuple[str, ...] = ()
) -> None:
    """Raise ``ConfigError`` if ``out`` equals, contains or lies inside one of ``inputs`` (setting -> path);
    lying inside is allowed for the settings in ``inside_ok`` (e.g. a cache inside the run folder)."""
    target = _resolved(out)
    for setting, path in inputs.items():
        if path is None or str(path) == "":
            continue
        other = _resolved(path)
        if target == other:
            relation = "is"
        elif other in target.parents and setting not in inside_ok:
            relation = "is inside"
        elif target in other.parents:
            relation = "contains"
        else:
            continue
        raise ConfigError(
            f"{out_setting}={str(out)!r} {relation} {setting}={str(path)!r}: the output folder is "
            f"replaced when rewritten, so it must be separate from the input; choose another folder"
        )


# ------------------------------------------------------------------------------------------ folders
def read_marker(folder: str | Path) -> dict | None:
    """The marker's record (``{"kind": ..., ...}``), or None when ``folder`` has none."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {"kind": "unreadable"}
    return record if isinstance(record, dict) else {"kind": "unreadable"}


def write_marker(folder: str | Path, kind: str, **record) -> None:
    """Mark ``folder`` as a ``kind`` folder of ours; ``record``: facts later commands check against
    (e.g. the classes a model was trained on)."""
    if kind not in KINDS:
        raise ValueError(f"unknown folder kind {kind!r}; known: {sorted(KINDS)}")
    note = f"written by mhla_gen: this {KINDS[kind][0]} folder is managed by it (its files may be replaced)"
    (Path(folder) / MARKER).write_text(json.dumps({"kind": kind, **record, "note": note}) + "\n")


def _listing(entries: list[str]) -> str:
    return ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")


def owned(folder: str | Path, kind: str, setting: str) -> bool:
    """True when ``folder`` is a ``kind`` folder of ours, False when it is absent or empty (free to use).

    Raises:
        ConfigError: naming ``setting``, for a file, a folder marked with another kind, or a non-empty
            folder without our marker (whatever the names of its entries).
    """
    folder = Path(folder)
    if not folder.exists():
        return False
    if not folder.is_dir():
        raise ConfigError(f"{setting}={str(folder)!r} is a file, not a folder; choose another path")
    entries = sorted(p.name for p in folder.iterdir())
    if not entries:
        return False
    marker = read_marker(folder)
    if marker is None:
        raise ConfigError(
            f"{setting}={str(folder)!r} is not empty and was not written by mhla_gen (no {MARKER}; it holds "
            f"{_listing(entries)}); nothing was changed: choose an empty or new folder. If an mhla_gen "
            f"version without markers wrote it, adopt it with: python -m mhla_gen.adopt {kind} {folder}"
        )
    if marker.get("kind") != kind:
        raise ConfigError(
            f"{setting}={str(folder)!r} is a {marker.get('kind')} folder of mhla_gen, not a {kind} "
            f"folder ({KINDS[kind][0]}); choose another folder"
        )
    return True


def foreign_entries(folder: str | Path, kind: str) -> list[str]:
    """Entries of ``folder`` that a ``kind`` folder does not hold (sorted names)."""
    known = KINDS[kind][1]
    return sorted(
        p.name for p in Path(folder).iterdir()
        if p.name != MARKER and not any(fnmatch.fnmatchcase(p.name, k) for k in known)
    )


def claim(folder: str | Path, kind: str, setting: str, **record) -> Path:
    """Create ``folder`` (or accept it, see :func:`owned`) and mark it as a ``kind`` folder."""
    folder = Path(folder)
    was_ours = owned(folder, kind, setting)
    folder.mkdir(parents=True, exist_ok=True)
    if not was_ours or record:
        kept = {k: v for k, v in (read_marker(folder) or {}).items() if k not in ("kind", "note")}
        write_marker(folder, kind, **{**kept, **record})
    return folder


def temp_sibling(final: str | Path) -> Path:
    """``.tmp-<name>`` next to ``final``: where its replacement is built."""
    final = Path(final)
    return final.with_name(f".tmp-{final.name}")


def check_temp(final: str | Path, kind: str, setting: str) -> bool:
    """:func:`owned` for the temporary sibling of ``final`` (call at start-up, before any work): True for a
    leftover of ours (removed by :func:`fresh_temp`), ``ConfigError`` for a folder of the user's."""
    tmp = temp_sibling(final)
    return owned(tmp, kind, f"{setting} (its temporary folder {tmp.name})")


def fresh_temp(final: str | Path, kind: str, setting: str) -> Path:
    """An empty, marked sibling ``.tmp-<name>`` of ``final`` to build a replacement in.

    A leftover temp folder of ours (an interrupted earlier run) is deleted and the command goes on; a
    user's folder of that name is never touched (``ConfigError``)."""
    tmp = temp_sibling(final)
    if check_temp(final, kind, setting):
        logger.warning("removing %s, left by an interrupted earlier run", tmp)
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    write_marker(tmp, kind)
    return tmp


def check_replaceable(final: str | Path, kind: str, setting: str, vouched: bool = False) -> bool:
    """Like :func:`owned`, and a ``kind`` folder of ours must also hold only entries of its kind (a
    user's file inside it would be deleted with it). True when ``final`` exists and would be replaced.

    ``vouched``: ``final`` is an entry of a folder of ours (a run's ``final/``), so that folder's marker
    covers it even if it has none of its own (written before model folders were marked)."""
    final = Path(final)
    if vouched and final.is_dir() and read_marker(final) is None:
        if not any(final.iterdir()):
            return False
    elif not owned(final, kind, setting):
        return False
    foreign = foreign_entries(final, kind)
    if foreign:
        raise ConfigError(
            f"{setting}={str(final)!r} is a {KINDS[kind][0]} folder of mhla_gen but also holds files it "
            f"did not write ({_listing(foreign)}); it would be replaced as a whole: move those files first"
        )
    return True


def replace_with(tmp: str | Path, final: str | Path, kind: str, setting: str, vouched: bool = False) -> Path:
    """Put the finished ``tmp`` in place of ``final``, deleting the old ``final`` only if it is ours
    (``vouched``: see :func:`check_replaceable`)."""
    final = Path(final)
    if check_replaceable(final, kind, setting, vouched):
        shutil.rmtree(final)
    elif final.is_dir():  # empty
        final.rmdir()
    os.replace(tmp, final)
    return final


def adopt(folder: str | Path, kind: str) -> Path:
    """Mark ``folder``, written by an mhla_gen without markers, as a ``kind`` folder (explicit, by the
    user). Refuses a folder holding entries a ``kind`` folder does not hold."""
    folder = Path(folder).expanduser()
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r} is not a folder kind of mhla_gen; choose one of {sorted(KINDS)}")
    if not folder.is_dir():
        raise FileNotFoundError(f"folder {str(folder)!r} does not exist")
    marker = read_marker(folder)
    if marker is not None:
        if marker.get("kind") != kind:
            raise ConfigError(f"{str(folder)!r} is already a {marker.get('kind')} folder of mhla_gen")
        return folder
    foreign = foreign_entries(folder, kind)
    if foreign:
        raise ConfigError(
            f"{str(folder)!r} holds entries a {KINDS[kind][0]} folder does not ({_listing(foreign)}); "
            f"not adopted"
        )
    write_marker(folder, kind, adopted=True)
    return folder


# -------------------------------------------------------------------------------------- single files
def file_record(kind: str) -> dict:
    """The record a JSON file of ours carries (merge it into the top-level object)."""
    return {FILE_RECORD: {"kind": kind}}


def file_is_ours(path: str | Path, kind: str) -> bool:
    """Whether ``path`` (a ``.json`` or ``.npz`` file) carries our record of ``kind``."""
    path = Path(path)
    try:
        if path.suffix == ".npz":
            import numpy as np

            with np.load(path, allow_pickle=False) as data:
                key = FILE_RECORD + "_kind"
                return key in data.files and str(data[key]) == kind
        record = json.loads(path.read_text())
        return isinstance(record, dict) and record.get(FILE_RECORD, {}).get("kind") == kind
    except (OSError, ValueError, AttributeError):
        return False


def check_writable(path: str | Path, setting: str) -> None:
    """``ConfigError`` now, rather than after the work, when ``path`` cannot be created or written."""
    path = Path(path)
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{setting}={str(path)!r}: {str(parent)!r} is a file, not a folder")
    target = path if path.exists() else parent
    if not os.access(target, os.W_OK):
        raise ConfigError(f"{setting}={str(path)!r} cannot be written ({str(target)!r} is read-only)")


def check_file_target(path: str | Path, setting: str, kind: str, overwrite: bool = False) -> Path:
    """Refuse (``ConfigError``) an output file that exists and is not ours unless ``overwrite``, a folder
    in its place, or a path that cannot be written. Call before any work."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"{setting}={str(path)!r} is a folder; give a file path")
    if path.exists() and not overwrite and not file_is_ours(path, kind):
        raise ConfigError(
            f"{setting}={str(path)!r} exists and was not written by mhla_gen; nothing was changed: choose "
            f"another path, or pass --overwrite to replace it"
        )
    check_writable(path, setting)
    return path
