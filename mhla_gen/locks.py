"""One writer per folder: an exclusive lock on every folder a command writes, and workers that die with
their parent.

:func:`lock_folder` takes ``fcntl.flock`` on ``FOLDER/.mhla_gen.lock`` (inside the folder, which is ours:
it was just claimed or marked) and writes the holder's pid into it. The kernel releases the lock when the
holder exits in any way (SIGKILL included), so a lock is never left behind; a file naming a dead pid is a
*stale* record, cleared with a message. A second command that wants the folder stops with a
:class:`~mhla_gen.errors.ConfigError` naming the holder's pid. Locks are re-entrant within a process (a
study trains one run folder in several segments) and released by :func:`release` or at exit.

:func:`die_with_parent` makes a worker process receive SIGKILL when its parent dies (Linux
``prctl(PR_SET_PDEATHSIG)``): the workers of eval/study.py and eval/adaptation.py and the ranks of a
multi-process launch stop with the command instead of writing on alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

from .errors import ConfigError

try:  # POSIX only; elsewhere folders are not locked (logged once)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

logger = logging.getLogger(__name__)

LOCK = ".mhla_gen.lock"
_held: dict[Path, int] = {}  # resolved folder -> open file descriptor holding its lock


def _key(folder: str | Path) -> Path:
    return Path(folder).expanduser().resolve()


def _read_pid(fd: int) -> int | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 64).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _busy(folder: str | Path, setting: str, pid: int | None) -> ConfigError:
    who = f"pid {pid}" if pid else "another process"
    return ConfigError(
        f"{setting}={str(folder)!r} is being written by another command ({who}); nothing was changed: "
        f"wait for it to finish (or stop it), or choose another folder"
    )


def holder(folder: str | Path) -> int | None:
    """The pid of another process holding ``folder``'s lock (0 when unknown), or None when it is free
    (or held by this process). Reads only."""
    key = _key(folder)
    path = key / LOCK
    if fcntl is None or key in _held or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_pid(fd) or 0
    finally:
        os.close(fd)  # closing drops a shared lock we got
    return None


def check_free(folder: str | Path, setting: str) -> None:
    """``ConfigError`` naming the holder's pid when another process writes ``folder`` (start-up check)."""
    pid = holder(folder)
    if pid is not None:
        raise _busy(folder, setting, pid)


def lock_folder(folder: str | Path, setting: str) -> Path:
    """Hold ``folder``'s lock until :func:`release` or exit (``folder`` must exist and be ours)."""
    key = _key(folder)
    if fcntl is None or key in _held:
        return key
    fd = os.open(key / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _read_pid(fd)
        os.close(fd)
        raise _busy(folder, setting, pid) from None
    previous = _read_pid(fd)
    if previous and previous != os.getpid() and not _alive(previous):
        logger.warning("%s: cleared a stale lock record of pid %d (no longer running)", key, previous)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[key] = fd
    return key


def release(folder: str | Path) -> None:
    """Give ``folder``'s lock back (no-op when this process does not hold it)."""
    fd = _held.pop(_key(folder), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


def main_rank() -> bool:
    """False in a non-zero rank of a multi-process launch (torchrun / accelerate set ``RANK``): such a
    process checks folders but never claims or locks them; rank 0 does."""
    return os.environ.get("RANK", "0") in ("", "0")


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent exits (Linux; elsewhere nothing). ``parent``: the pid the
    parent had when it started us; if it is already gone, exit now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent is not None and os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
