"""Small file helpers: atomic writes and the metrics.jsonl log."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file + ``os.replace``: readers never see half a file.
    The file gets the permissions of any file the user creates (``mkstemp``'s 0600 widened by the umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.fchmod(fd, 0o666 & ~_umask())
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append one JSON line (one write call: a killed job leaves at most one partial last line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    """All complete records; a truncated last line (killed job) is ignored."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
