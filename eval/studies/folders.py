"""Which runner a study folder belongs to.

Every study runner (``eval/study.py``, ``eval/adaptation.py``, ``eval/scale_study.py``,
``eval/stream_study.py``) writes a ``study`` folder (:mod:`mhla_gen.outputs.folders`) holding its own
``record.npz`` and report. The folder kind alone does not tell them apart, so a study folder given to
another runner would get that runner's runs beside its own and its record replaced. :func:`claim_study`
records the runner in the folder's marker and refuses a folder of another runner before any write.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import claim, file_is_ours, read_marker

RECORD_KIND = "study_record"  # eval/results.py's record (what every runner writes as OUT/record.npz)


def study_runner(out: Path) -> str | None:
    """The runner whose study folder ``out`` is: the one its marker names, else the one its ``record.npz``
    names (a folder marked before 2026-11-29 names none in its marker); None when neither says."""
    marker = read_marker(out) or {}
    if marker.get("kind") == "study" and marker.get("runner"):
        return str(marker["runner"])
    record = Path(out) / "record.npz"
    if not file_is_ours(record, RECORD_KIND):
        return None
    try:
        with np.load(record, allow_pickle=False) as data:
            meta = json.loads(bytes(data["meta"]).decode())
    except (zipfile.BadZipFile, ValueError, KeyError, OSError):
        return None
    return str(meta["runner"]) if isinstance(meta, dict) and meta.get("runner") else None


def check_runner(out: Path, runner: str, setting: str = "--out") -> None:
    """``ConfigError`` naming ``setting`` when ``out`` is a study folder of a runner other than
    ``eval/<runner>.py``."""
    found = study_runner(out) if Path(out).is_dir() else None
    if found not in (None, runner):
        raise ConfigError(f"{setting} {str(out)!r} is a study folder of eval/{found}.py, not of "
                          f"eval/{runner}.py (its record.npz and report would be replaced); nothing was "
                          f"changed: choose another {setting}")


def claim_study(out: Path, runner: str, setting: str = "--out") -> Path:
    """:func:`mhla_gen.outputs.folders.claim` of ``out`` as a study folder of ``eval/<runner>.py`` (its marker
    names the runner), after :func:`check_runner`."""
    check_runner(out, runner, setting)
    return claim(out, "study", setting, runner=runner)
