"""Folders this project writes into, and the rule that keeps everything else safe.

A folder that mhla_gen creates (a training run's ``output_dir``, a latent cache, a feature cache) gets a
marker file, ``.mhla_gen.json``, naming what kind of folder it is. Code that deletes or replaces files
only does so inside a folder that

* holds the marker of the same kind, and nothing but entries of that kind (``known``), or
* is empty or does not exist yet, or
* (folders written before markers existed) holds only entries of that kind.

Anything else (an unrelated file, a data set, a folder of another kind) is refused with a ``ConfigError``
(a ``ValueError``) naming the setting, the folder and the entries that are not ours. :func:`check_apart`
refuses an output that is, contains or lies inside an input (``--out`` = ``--data`` would otherwise replace
the data).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path

from .errors import ConfigError

MARKER = ".mhla_gen.json"


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


def read_marker(folder: str | Path) -> dict | None:
    """The marker's content (``{"kind": ...}``), or None when ``folder`` has none."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {"kind": "unreadable"}


def write_marker(folder: str | Path, kind: str) -> None:
    note = f"written by mhla_gen: this {kind} folder is managed by it (its files may be replaced)"
    (Path(folder) / MARKER).write_text(json.dumps({"kind": kind, "note": note}) + "\n")


def check_owned(folder: str | Path, kind: str, setting: str, known: frozenset[str]) -> bool:
    """True when ``folder`` exists and may be modified as a ``kind`` folder, False when it is absent or
    empty; raises ``ConfigError`` (naming ``setting``) for a folder that is not ours. ``known``: the names
    (``fnmatch`` patterns) of the entries a ``kind`` folder holds."""
    folder = Path(folder)
    if not folder.exists():
        return False
    if not folder.is_dir():
        raise ConfigError(f"{setting}={str(folder)!r} is a file, not a folder")
    entries = sorted(p.name for p in folder.iterdir())
    if not entries:
        return False
    marker = read_marker(folder)
    if marker is not None and marker.get("kind") != kind:
        raise ConfigError(
            f"{setting}={str(folder)!r} is a {marker.get('kind')} folder of mhla_gen, not a {kind} folder; "
            f"choose another folder"
        )
    foreign = [e for e in entries if e != MARKER and not any(fnmatch.fnmatchcase(e, k) for k in known)]
    if foreign:
        raise ConfigError(
            f"{setting}={str(folder)!r} is not empty and holds files mhla_gen did not write there "
            f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); nothing was changed: "
            f"choose an empty or new folder, or move those files"
        )
    return True


def claim(folder: str | Path, kind: str, setting: str, known: frozenset[str]) -> Path:
    """Create ``folder`` (or accept it, see :func:`check_owned`) and mark it as a ``kind`` folder."""
    folder = Path(folder)
    check_owned(folder, kind, setting, known)
    folder.mkdir(parents=True, exist_ok=True)
    if read_marker(folder) is None:
        write_marker(folder, kind)
    return folder


def fresh_temp(final: str | Path, kind: str, setting: str, known: frozenset[str]) -> Path:
    """An empty, marked sibling ``.tmp-<name>`` of ``final`` to build a replacement in. A leftover one
    from an interrupted run is deleted only if it is ours."""
    final = Path(final)
    tmp = final.with_name(f".tmp-{final.name}")
    if check_owned(tmp, kind, f"{setting} (its temporary folder)", known):
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    write_marker(tmp, kind)
    return tmp


def replace_with(tmp: str | Path, final: str | Path, kind: str, setting: str, known: frozenset[str]) -> Path:
    """Put the finished ``tmp`` in place of ``final``, deleting the old ``final`` only if it is ours."""
    final = Path(final)
    if check_owned(final, kind, setting, known) or final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final
