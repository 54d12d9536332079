"""Which files and folders are this project's, and the rules every writer follows (DESIGN.md §7).

**A folder is ours only if we marked it.** A folder that mhla_gen creates (a training run's
``output_dir``, a latent or feature cache, a sample set, a model folder, a temporary ``.tmp-<name>``)
gets a marker file, ``.mhla_gen.json``, naming its *kind*. Names prove nothing: a user's
``config.yaml``, ``meta.json``, ``metrics.jsonl`` or ``000000.png`` look exactly like ours. So

* an absent or empty folder may be created / used (and is marked);
* a folder marked with the same kind is ours: its files may be written and replaced;
* a non-empty unmarked folder, a folder marked with another kind, or a file where a folder should be
  is refused with a :class:`ConfigError` naming the setting, before any work. A folder that an earlier
  mhla_gen (before markers) wrote can be adopted explicitly: ``mhla-gen adopt KIND FOLDER``,
  which proves its content (:mod:`mhla_gen.commands.adopt`).

**Delete only what you listed.** A writer removes or replaces only files its own listing names (relative
path and byte size of each file it wrote: the marker's ``files`` for a folder built whole, :func:`seal`;
the journal ``.mhla_gen.files.jsonl`` of a writer that adds files one by one, :func:`record_files`),
never by pattern: :func:`remove_listed` leaves every other file
alone, and a folder replaced *wholesale* (a cache rebuilt in a temporary sibling, a model folder) is
refused by :func:`check_replaceable` when it holds a file its listing does not name (or a listed file
whose size changed). A temporary ``.tmp-<name>`` folder is created empty and marked by the command that
builds in it and sealed (its files listed) before it is put in place; a leftover one of ours is deleted
only if it holds exactly what it lists (:func:`discard`), else left with a warning while the command
builds in a new ``.tmp-<name>-<pid>`` (:func:`fresh_temp`).

**Inputs and outputs apart.** :func:`check_apart` is the one check every entry point makes at start-up:
no output folder is, contains or lies inside one of the command's inputs (teacher, start point, data,
VAE, another run's cache, reference sets), compared as resolved real paths (symlinks followed).

**One writer per folder.** :func:`claim` and :func:`fresh_temp` lock the folder they hand out
(:mod:`mhla_gen.outputs.locks`); :func:`owned` refuses a folder another live command holds. A single output file
is locked with :func:`mhla_gen.outputs.locks.lock_file` (a sibling ``.<name>.mhla_gen.lock`` while it is written).

**Recorded inputs cannot drift.** :func:`input_record` stores an input resolved and absolute with a
fingerprint (sizes and a sampled hash of its weights); :func:`check_recorded` refuses one that moved or
changed.

**A single file is ours only if it carries our record**: JSON files written by the eval scripts hold
``{"mhla_gen": {"kind": ...}}`` and ``.npz`` files an array ``mhla_gen_kind`` (a record inside the file
rather than a sidecar file beside it, so that it cannot be separated from the file it describes). An
existing file without it is replaced only when the user says ``--overwrite``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import zipfile
from pathlib import Path

from ..errors import ConfigError
from .locks import LOCK, check_free, holder, lock_folder, main_rank, release

logger = logging.getLogger(__name__)

MARKER = ".mhla_gen.json"
LISTING = ".mhla_gen.files.jsonl"  # the files we wrote into a marked folder: {"name", "bytes"} per line
BOOKKEEPING = frozenset({MARKER, LISTING, LOCK})  # our records, not content
FILE_RECORD = "mhla_gen"  # key of the record in a JSON file; .npz: FILE_RECORD + "_kind"

# kind -> what it is (mhla-gen adopt proves a folder's content per kind)
KINDS: dict[str, str] = {
    "run": "training run (output_dir)",
    "checkpoint": "training checkpoint (output_dir/checkpoints/checkpoint_<step>)",
    "latent_cache": "DiT latent cache",
    "feature_cache": "SANA / Wan feature cache",
    "teacher_data": "teacher-sampled training data",
    "samples": "evaluation sample set (eval/generate.py)",
    "sample_outputs": "scripts/sample.py output",
    "model": "transformer folder (save_pretrained)",
    "pipeline": "pipeline folder (mhla_gen.pipelines.saving.save_pipeline)",
    "attention_stats": "attention statistics",
    "study": "study (eval/study.py)",
    "diffusers_tests": "diffusers test export (scripts/diffusers_model_tests.py)",
    "gpu_check": "GPU check section outputs (scripts/gpu_check.py)",
}


def adopt_command(kind: str, folder: str | Path) -> str:
    """The command that adopts (marks and lists) ``folder`` as a ``kind`` folder; every refusal of a folder
    an earlier version wrote ends with it."""
    return f"mhla-gen adopt {kind} {shlex.quote(str(folder))}"


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


# ------------------------------------------------------------------------------ inputs and outputs
def check_apart(
    out: str | Path, out_setting: str, inputs: dict[str, str | Path | None], inside_ok: tuple[str, ...] = (),
    holds_ok: tuple[str, ...] = (),
) -> None:
    """Raise ``ConfigError`` naming both settings if the output ``out`` is, contains or lies inside one
    of ``inputs`` (setting -> local path; hub ids and absent paths cannot be harmed and are skipped).
    Paths are compared resolved (``~`` expanded, symlinks followed). ``out`` may lie inside the inputs
    named in ``inside_ok`` (a cache inside its run's output_dir) and hold those in ``holds_ok`` (a run
    folder holding the cache it writes itself)."""
    target = _resolved(out)
    for setting, path in inputs.items():
        if path is None or str(path) == "" or not Path(path).expanduser().exists():
            continue
        other = _resolved(path)
        if target == other:
            relation = "is"
        elif other in target.parents and setting not in inside_ok:
            relation = "is inside"
        elif target in other.parents and setting not in holds_ok:
            relation = "contains"
        else:
            continue
        shown = f"{str(path)!r}" + (f" (= {str(other)!r})" if str(other) != str(path) else "")
        raise ConfigError(
            f"{out_setting}={str(out)!r} {relation} {setting}={shown}, an input of this command: a command "
            f"never writes where its inputs are; nothing was changed: choose another {out_setting}"
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
    note = f"written by mhla_gen: this {KINDS[kind]} folder is managed by it (the files it lists may be " \
        "replaced)"
    (Path(folder) / MARKER).write_text(json.dumps({"kind": kind, **record, "note": note}) + "\n")


def _listing(entries: list[str]) -> str:
    return ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")


def content(folder: str | Path) -> list[str]:
    """The entries of ``folder`` besides our bookkeeping (marker, listing, lock), sorted."""
    return sorted(p.name for p in Path(folder).iterdir() if p.name not in BOOKKEEPING)


def owned(folder: str | Path, kind: str, setting: str) -> bool:
    """True when ``folder`` is a ``kind`` folder of ours, False when it is absent or empty (free to use).

    Raises:
        ConfigError: naming ``setting``, for a file, a symbolic link, a folder marked with another kind,
            a non-empty folder without our marker (whatever the names of its entries), or a folder
            another running command holds (its pid named).
    """
    folder = Path(folder).expanduser()
    if folder.is_symlink():
        raise ConfigError(
            f"{setting}={str(folder)!r} is a symbolic link (to {str(folder.resolve())!r}); nothing was "
            f"changed: give the folder itself, or a new path"
        )
    if not folder.exists():
        return False
    if not folder.is_dir():
        raise ConfigError(f"{setting}={str(folder)!r} is a file, not a folder; choose another path")
    entries = content(folder)
    marker = read_marker(folder)
    if not entries and marker is None:
        return False
    if marker is None:
        raise ConfigError(
            f"{setting}={str(folder)!r} is not empty and was not written by mhla_gen (no {MARKER}; it holds "
            f"{_listing(entries)}); nothing was changed: choose an empty or new folder. If an mhla_gen "
            f"version without markers wrote it, adopt it with: {adopt_command(kind, folder)}"
        )
    if marker.get("kind") != kind:
        raise ConfigError(
            f"{setting}={str(folder)!r} is a {marker.get('kind')} folder of mhla_gen, not a {kind} "
            f"folder ({KINDS[kind]}); choose another folder"
        )
    if main_rank():  # the other ranks of a launch check while rank 0 holds the lock
        check_free(folder, setting)
    return True


def claim(folder: str | Path, kind: str, setting: str, **record) -> Path:
    """Create ``folder`` (or accept it, see :func:`owned`), mark it as a ``kind`` folder and hold its lock
    (:func:`mhla_gen.outputs.locks.lock_folder`) until the command ends."""
    folder = Path(folder).expanduser()
    was_ours = owned(folder, kind, setting)
    folder.mkdir(parents=True, exist_ok=True)
    lock_folder(folder, setting)
    if not was_ours or record:
        kept = {k: v for k, v in (read_marker(folder) or {}).items() if k not in ("kind", "note")}
        write_marker(folder, kind, **{**kept, **record})
    return folder


# ------------------------------------------------------------------------------------------ listings
def _files(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` (relative posix path -> bytes), our bookkeeping left out."""
    found = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if rel in BOOKKEEPING or path.is_dir():
            continue
        found[rel] = path.lstat().st_size
    return found


def record_files(folder: str | Path, *names: str, pending: bool = False) -> None:
    """Add files of ``folder`` (relative names) to its listing, with their current size; ``pending``: a
    name this command is about to write (listed before it exists, any size)."""
    folder = Path(folder)
    lines = "".join(
        json.dumps({"name": name, "bytes": None if pending else (folder / name).stat().st_size}) + "\n"
        for name in names
    )
    fd = os.open(folder / LISTING, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, lines.encode())  # one append: processes writing one folder do not interleave lines
    finally:
        os.close(fd)


def listed(folder: str | Path) -> dict[str, int | None] | None:
    """``{name: bytes}`` of the files ``folder``'s listing names: the marker's ``files`` (a sealed folder)
    and the journal of an incremental writer (the last record of a name wins; None: written, size
    unknown), or None when the folder has neither."""
    path = Path(folder) / LISTING
    sealed = (read_marker(folder) or {}).get("files")
    if not path.is_file():
        return dict(sealed) if isinstance(sealed, dict) else None
    names: dict[str, int | None] = dict(sealed) if isinstance(sealed, dict) else {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
            names[str(entry["name"])] = entry.get("bytes")
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line of a killed writer
    return names


def seal(folder: str | Path) -> None:
    """List every file now in ``folder`` (a folder this command built from empty, e.g. a temporary sibling
    before it is put in place) in its marker (``files``): later commands may replace exactly these."""
    folder = Path(folder)
    (folder / LISTING).unlink(missing_ok=True)
    record = read_marker(folder) or {}
    kept = {k: v for k, v in record.items() if k not in ("kind", "note", "files", "temporary")}
    write_marker(folder, record["kind"], **kept, files=_files(folder))


def unlisted(folder: str | Path) -> list[str]:
    """Files under ``folder`` its listing does not name, or names with another size (relative paths)."""
    names = listed(folder) or {}
    return [rel for rel, size in _files(Path(folder)).items()
            if rel not in names or names[rel] not in (None, size)]


def remove_listed(folder: str | Path, setting: str) -> list[str]:
    """Delete the files ``folder``'s listing names (those whose size still matches) and the folders they
    leave empty; return what is left (entries of the user's), which the caller reports."""
    folder = Path(folder)
    names = listed(folder) or {}
    for rel, size in names.items():
        path = folder / rel
        if path.is_file() and not path.is_symlink() and size in (None, path.stat().st_size):
            path.unlink()
    for rel in sorted({str(Path(r).parent) for r in names if Path(r).parent != Path(".")}, reverse=True):
        try:
            (folder / rel).rmdir()
        except OSError:
            pass  # not empty: it holds something we did not list
    (folder / LISTING).unlink(missing_ok=True)
    record = read_marker(folder)
    if record is not None and "files" in record:
        write_marker(folder, record["kind"], **{k: v for k, v in record.items() if k not in ("kind", "note",
                                                                                          "files")})
    left = content(folder)
    if left:
        logger.warning("%s=%s: left untouched what mhla_gen did not write there: %s", setting, folder,
                       _listing(left))
    return left


# ---------------------------------------------------------------------------- temporary siblings
def temp_sibling(final: str | Path) -> Path:
    """``.tmp-<name>`` next to ``final``: where its replacement is built."""
    final = Path(final).expanduser()
    return final.with_name(f".tmp-{final.name}")


def check_temp(final: str | Path, kind: str, setting: str) -> bool:
    """:func:`owned` for the temporary sibling of ``final`` (call at start-up, before any work): True for a
    leftover of ours (:func:`fresh_temp` removes it if it holds exactly what it lists, and otherwise leaves
    it and builds in a new temporary folder), ``ConfigError`` for a folder of the user's."""
    tmp = temp_sibling(final)
    return owned(tmp, kind, f"{setting} (its temporary folder {tmp.name})")


def strays(folder: str | Path) -> list[str]:
    """Entries under ``folder`` (relative paths) that its listing does not account for: files it does not
    name or names with another size, symbolic links, other non-files, and folders that hold no listed
    file. Empty when ``folder`` holds exactly (a part of) what its listing names."""
    folder = Path(folder)
    names = listed(folder) or {}
    parents = {parent.as_posix() for rel in names for parent in Path(rel).parents if parent != Path(".")}
    found = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if rel in BOOKKEEPING:
            continue
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            found.append(rel)
        elif path.is_dir():
            if rel not in parents:
                found.append(rel)
        elif rel not in names or names[rel] not in (None, path.stat().st_size):
            found.append(rel)
    return found


def discard(folder: str | Path, kind: str, setting: str) -> bool:
    """Delete ``folder``, a ``kind`` folder of ours, if it holds exactly what its listing names (True).
    Anything else (not marked as ours, marked with another kind, held by a running command, or holding an
    entry its listing does not name) is left untouched with a warning naming the path (False); a folder of
    an earlier version (marked, no listing) gets the ``adopt`` command that lists its files."""
    folder = Path(folder)
    marker = None if folder.is_symlink() or not folder.is_dir() else read_marker(folder)
    if marker is None and folder.is_dir() and not folder.is_symlink():
        logger.warning("%s: %s was not marked by mhla_gen; left untouched. If an mhla_gen version without "
                       "markers wrote it, adopt it with: %s", setting, folder, adopt_command(kind, folder))
        return False
    if marker is None or marker.get("kind") != kind:
        logger.warning("%s: %s is not a %s folder of mhla_gen; left untouched", setting, folder, KINDS[kind])
        return False
    pid = holder(folder)
    if pid is not None:
        logger.warning("%s: %s is being written by pid %s; left untouched", setting, folder, pid)
        return False
    extra = strays(folder)
    if extra and listed(folder) is None and not marker.get("temporary"):
        logger.warning("%s: %s has no list of the files mhla_gen wrote (an earlier version); left untouched: "
                       "list them with: %s", setting, folder, adopt_command(kind, folder))
        return False
    if extra:
        logger.warning("%s: %s holds entries its list of files does not name (%s); left untouched: look at "
                       "them, then delete the folder yourself", setting, folder, _listing(extra))
        return False
    remove_listed(folder, setting)
    for leftover in (MARKER, LOCK):
        (folder / leftover).unlink(missing_ok=True)
    folder.rmdir()
    return True


def fresh_temp(final: str | Path, kind: str, setting: str, lock: bool = True) -> Path:
    """An empty, marked (and, with ``lock``, locked) temporary sibling of ``final`` to build a replacement in.

    The temporary folder is ``.tmp-<name>``. A leftover one of ours (an interrupted earlier run) is deleted
    if it holds exactly what its listing names (:func:`discard`); otherwise it is left in place with a
    warning naming it, and the replacement is built in ``.tmp-<name>-<pid>`` instead, so nothing is lost. A
    user's folder named ``.tmp-<name>`` is never touched (``ConfigError``), nor one another running command
    builds in (its pid named)."""
    tmp = temp_sibling(final)
    if check_temp(final, kind, setting):
        if discard(tmp, kind, f"{setting} (its temporary folder)"):
            logger.warning("%s: removed %s, left by an interrupted earlier run", setting, tmp)
        else:
            left, tmp = tmp, tmp.with_name(f"{tmp.name}-{os.getpid()}")
            while tmp.exists() or tmp.is_symlink():  # a leftover of an earlier process with our pid
                tmp = tmp.with_name(f"{tmp.name}-")
            logger.warning("%s: %s (left by an interrupted earlier run) stays where it is; building in %s",
                           setting, left, tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    write_marker(tmp, kind, temporary=True)
    if lock:
        lock_folder(tmp, f"{setting} (its temporary folder {tmp.name})")
    return tmp


def check_replaceable(final: str | Path, kind: str, setting: str) -> bool:
    """Like :func:`owned`, and a ``kind`` folder of ours must also hold only the files its listing names
    (a user's file inside it would be deleted with it). True when ``final`` exists and would be replaced."""
    final = Path(final).expanduser()
    if not owned(final, kind, setting):
        return False
    if listed(final) is None and content(final):
        raise ConfigError(
            f"{setting}={str(final)!r} is a {kind} folder of mhla_gen without a list of the files it wrote "
            f"(an earlier version); nothing was changed: choose another folder, or list them with: "
            f"{adopt_command(kind, final)}"
        )
    foreign = unlisted(final)
    if foreign:
        raise ConfigError(
            f"{setting}={str(final)!r} is a {KINDS[kind]} folder of mhla_gen but also holds files it "
            f"did not write ({_listing(foreign)}); it would be replaced as a whole: move those files first"
        )
    return True


def replace_with(tmp: str | Path, final: str | Path, kind: str, setting: str) -> Path:
    """Seal the finished ``tmp`` (list its files) and put it in place of ``final``, deleting the old
    ``final`` only if it is ours and holds nothing but what it lists (:func:`check_replaceable`)."""
    final = Path(final).expanduser()
    seal(tmp)
    (Path(tmp) / LOCK).unlink(missing_ok=True)  # the lock stays held (open descriptor) until release
    if check_replaceable(final, kind, setting):
        remove_listed(final, setting)
        for leftover in (MARKER, LOCK):
            (final / leftover).unlink(missing_ok=True)
        final.rmdir()
    elif final.is_dir():  # empty (or only a marker of ours)
        for leftover in (MARKER, LOCK):
            (final / leftover).unlink(missing_ok=True)
        final.rmdir()
    os.replace(tmp, final)
    release(tmp)  # its lock (held on the folder, now at final) ends with the writing
    return final


# ---------------------------------------------------------------------------------- recorded inputs
WEIGHTS = (".safetensors", ".bin", ".pth", ".pt", ".ckpt", ".json")  # what a model fingerprint reads
_CHUNKS, _CHUNK = 16, 1 << 16  # sampled bytes per file: 16 x 64 KiB (a retrained model differs in each)


def torch_archive_cut(path: Path) -> bool:
    """Whether ``path`` begins as a ``torch.save`` zip archive but has no readable central directory (cut
    short: torch.load would fail with a RuntimeError). Reads the header and the end of the file only."""
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            return False  # not a zip archive (e.g. a legacy pickle): not ours to judge
    return not zipfile.is_zipfile(path)


def fingerprint(path: str | Path) -> dict:
    """``{"bytes", "files", "sha256"}`` of a model file or folder: the names and sizes of its weight and
    config files and a hash of ``_CHUNKS`` evenly spaced ``_CHUNK``-byte samples of each (whole small
    files), so a moved, retrained or replaced model is noticed without reading gigabytes."""
    path = _resolved(path)
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix in WEIGHTS and p.name not in BOOKKEEPING
    )
    digest, total = hashlib.sha256(), 0
    for file in files:
        size = file.stat().st_size
        total += size
        digest.update(f"{file.relative_to(path).as_posix() if file != path else file.name}:{size}\n".encode())
        with open(file, "rb") as f:
            if size <= _CHUNKS * _CHUNK:
                digest.update(f.read())
                continue
            for k in range(_CHUNKS):
                f.seek(k * (size - _CHUNK) // (_CHUNKS - 1))
                digest.update(f.read(_CHUNK))
    return {"bytes": total, "files": len(files), "sha256": digest.hexdigest()}


def input_record(source: str | Path | None) -> dict | None:
    """How an input is recorded with what it made: a local path resolved and absolute with its
    :func:`fingerprint`, or a hub id as given (None for None)."""
    if source is None or str(source) == "":
        return None
    local = Path(source).expanduser()
    if not local.exists():
        return {"hub": str(source)}
    return {"path": str(local.resolve()), **fingerprint(local)}


def check_recorded(record: dict | None, what: str, fix: str) -> str:
    """The path of the input ``record`` (:func:`input_record`) describes, after checking it is still
    there and unchanged; ``ConfigError`` naming ``what`` and the way out ``fix`` otherwise."""
    if not isinstance(record, dict) or not ("path" in record or "hub" in record):
        raise ConfigError(f"{what} is recorded without its resolved path and fingerprint (written by an "
                          f"earlier mhla_gen); {fix}")
    if "hub" in record:
        return record["hub"]
    path = Path(record["path"])
    if not path.exists():
        raise ConfigError(f"{what} {record['path']!r} no longer exists (moved or deleted); {fix}")
    now = fingerprint(path)
    if any(now[k] != record.get(k) for k in ("bytes", "files", "sha256")):
        was = f"{record.get('bytes')} bytes, hash {str(record.get('sha256'))[:12]}"
        raise ConfigError(f"{what} {record['path']!r} has changed since it was recorded (its weights differ: "
                          f"{was} -> {now['bytes']} bytes, hash {now['sha256'][:12]}); {fix}")
    return record["path"]


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
