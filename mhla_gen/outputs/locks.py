"""One writer per folder: an exclusive lock on every folder a command writes, and workers that die with
their parent.

:func:`lock_folder` takes ``fcntl.flock`` on ``FOLDER/.mhla_gen.lock`` (inside the folder, which is ours:
it was just claimed or marked) and writes the holder's pid into it. The kernel releases the lock when the
holder exits in any way (SIGKILL included), so a lock is never left behind; a holder that releases it
(or exits normally) empties the record, so a file naming a dead pid is a *stale* record of a holder that
was killed, cleared with a message. A second command that wants the folder stops with a
:class:`~mhla_gen.errors.ConfigError` naming the holder's pid. Locks are re-entrant within a process (a
study trains one run folder in several segments) and released by :func:`release` or at exit.

:func:`lock_file` does the same for a single output file (a metrics JSON, a benchmark report) with a
sibling ``.<name>.mhla_gen.lock`` that exists only while the writer runs; :func:`writing_files` holds such
locks around a writer's work.

:func:`die_with_parent` makes a worker process receive SIGKILL when its parent dies (Linux
``prctl(PR_SET_PDEATHSIG)``): the workers of eval/study.py and eval/adaptation.py stop with the command
instead of writing on alone. That watches the direct parent only, so a multi-process launch is covered
in two links: each rank watches its launcher (:func:`die_with_launcher`: eval/generate.py and the
training scripts), and a launcher that a process of ours starts watches that process
(:func:`dying_with_us`; it gets SIGTERM, on which torchrun and ``accelerate launch`` stop their workers).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError

try:  # POSIX only; elsewhere folders are not locked (logged once)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

logger = logging.getLogger(__name__)

LOCK = ".mhla_gen.lock"
FILE_LOCK_SUFFIX = ".mhla_gen.lock"  # .<name>.mhla_gen.lock beside a single output file
_held: dict[Path, int] = {}  # resolved folder (or file lock) -> open file descriptor holding its lock
_files: set[Path] = set()  # the file locks among them (removed on release); the rest are folder locks


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


def _take(fd: int, where: str | Path, setting: str) -> None:
    """Lock ``fd`` without waiting; if another process holds it, close ``fd`` and raise naming the holder."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _read_pid(fd)
        os.close(fd)
        raise _busy(where, setting, pid) from None


def _hold(key: Path, fd: int, where: Path) -> None:
    """Record this process in the locked ``fd`` (warning about a dead holder's leftover record) and keep
    ``fd`` open under ``key`` until release."""
    previous = _read_pid(fd)
    if previous and previous != os.getpid() and not _alive(previous):
        logger.warning("%s: cleared a stale lock record of pid %d (no longer running)", where, previous)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[key] = fd


def lock_folder(folder: str | Path, setting: str) -> Path:
    """Hold ``folder``'s lock until :func:`release` or exit (``folder`` must exist and be ours)."""
    key = _key(folder)
    if fcntl is None or key in _held:
        return key
    fd = os.open(key / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    _take(fd, folder, setting)
    _hold(key, fd, key)
    return key


def release(folder: str | Path) -> None:
    """Give ``folder``'s lock back and empty its pid record (no-op when this process does not hold it):
    only a holder that died without releasing leaves a pid behind, the stale record the next one reports."""
    fd = _held.pop(_key(folder), None)
    if fd is not None:
        try:
            os.ftruncate(fd, 0)
        except OSError:  # a folder on a read-only remount: the lock still goes with the descriptor
            pass
        os.close(fd)  # closing the descriptor releases the flock


def _release_folders() -> None:
    """At exit: release the folders this process locked (a forked child that inherited them, and exits
    through ``sys.exit``, leaves its parent's records alone)."""
    for key in [key for key in _held if key not in _files]:
        if _read_pid(_held[key]) == os.getpid():
            release(key)


atexit.register(_release_folders)


# ------------------------------------------------------------------------------------ single files
def file_lock_path(path: str | Path) -> Path:
    """``.<name>.mhla_gen.lock`` beside the output file ``path``: the lock of one file."""
    path = Path(path).expanduser()
    return path.with_name(f".{path.name}{FILE_LOCK_SUFFIX}")


def _open_file_lock(lock: Path, path: Path, setting: str) -> int:
    """An open descriptor of ``lock``, created new, or an existing one that is a lock record of ours (a pid
    line of a writer that was killed); ``ConfigError`` for anything else of that name."""
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    text = lock.read_bytes()[:64] if lock.is_file() and not lock.is_symlink() else b"not a file"
    if len(text) > 32 or (text.strip() and not text.strip().isdigit()):
        raise ConfigError(f"{setting}={str(path)!r}: {str(lock)!r} exists and is not a lock record of "
                          f"mhla_gen; nothing was changed: move it away")
    return os.open(lock, os.O_RDWR)


def lock_file(path: str | Path, setting: str) -> Path:
    """Hold the lock of the output file ``path`` until :func:`release_file` or exit.

    The lock is ``fcntl.flock`` on a sibling ``.<name>.mhla_gen.lock`` holding the writer's pid, created
    next to the file and removed on release: the folder an output file goes to is usually the user's (a
    results folder), so its folder lock would write into the user's folder for as long as the folder
    exists; this writes one hidden file there only while the command runs (one left by a killed writer is
    a stale record, cleared with a message by the next writer and removed on its release). A second
    writer of the same file stops with a :class:`ConfigError` naming the holder's pid."""
    path = Path(path).expanduser()
    lock = file_lock_path(path)
    key = _key(lock)
    if fcntl is None or key in _held:
        return key
    while True:
        fd = _open_file_lock(lock, path, setting)
        _take(fd, path, setting)
        try:  # the holder removes the file on release: a descriptor of the removed file locks nothing
            current = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    _hold(key, fd, lock)
    _files.add(key)
    return key


def release_file(path: str | Path) -> None:
    """Give the lock of output file ``path`` back and remove its lock file (no-op when not held)."""
    key = _key(file_lock_path(path))
    fd = _held.pop(key, None)
    _files.discard(key)
    if fd is not None:
        key.unlink(missing_ok=True)  # while still locked: a writer that opened it before retries
        os.close(fd)


def _release_files() -> None:
    for key in list(_files):
        release_file(key.with_name(key.name[1:-len(FILE_LOCK_SUFFIX)]))


atexit.register(_release_files)


@contextmanager
def writing_files(*targets: tuple[str | Path | None, str]):
    """Context: the locks of the output files ``(path, setting)`` (None paths skipped) held inside."""
    taken = []
    try:
        for path, setting in targets:
            if path is not None:
                lock_file(path, setting)
                taken.append(path)
        yield
    finally:
        for path in taken:
            release_file(path)


def main_rank() -> bool:
    """False in a non-zero rank of a multi-process launch (torchrun / accelerate set ``RANK``): such a
    process checks folders but never claims or locks them; rank 0 does."""
    return os.environ.get("RANK", "0") in ("", "0")


def die_with_parent(parent: int | None = None, signum: int = signal.SIGKILL) -> None:
    """Receive ``signum`` (SIGKILL) when this process's parent exits (Linux; elsewhere nothing).
    ``parent``: the pid the parent had when it started us; if it is already gone, exit now.

    Only the direct parent is watched (``prctl(PR_SET_PDEATHSIG)``): a worker of a launcher watches the
    launcher (:func:`die_with_launcher`), and a launcher started by one of our processes watches that
    process (:func:`dying_with_us`)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if parent is not None and os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def launched() -> bool:
    """Started as a rank of a multi-process launcher (torchrun / accelerate launch set ``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 or not main_rank()


def die_with_launcher() -> None:
    """In a rank of torchrun / ``accelerate launch`` (:func:`launched`): SIGKILL when the launcher dies.
    A launcher stopped by Ctrl-C or SIGTERM stops its workers itself; a SIGKILLed one cannot, and its
    workers would go on writing (the ranks of eval/generate.py and of the training scripts call this)."""
    if launched():
        die_with_parent()


def dying_with_us() -> Callable[[], None]:
    """``preexec_fn`` for ``subprocess.Popen`` of a launcher (torchrun, ``accelerate launch``): the launcher
    gets SIGTERM when this process dies, however it dies (SIGKILL included), and on SIGTERM it stops its
    workers. PR_SET_PDEATHSIG is kept across ``execve``, so it holds for the launched program."""
    return functools.partial(die_with_parent, os.getpid(), signal.SIGTERM)
