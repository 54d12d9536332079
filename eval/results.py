"""Records of the studies, and the command that regenerates every committed table and plot from them.

    python eval/results.py regenerate              # every record of docs/results/records/manifest.json
    python eval/results.py regenerate --check      # compare instead: exit 1 naming each file that differs
    python eval/results.py render runs/study/record.npz --out DIR   # any record's tables and plots
    python eval/results.py add runs/study NAME     # a study's record into docs/results/records/NAME/

A **record** (``record.npz``, written by every ``eval/study.py`` / ``eval/adaptation.py`` call beside its
report) is everything the report is rendered from, so the tables and plots need no run folder:

* ``meta`` (JSON): the runner (``eval/<runner>.py``, which renders the record: ``render(record, folder)``),
  its command, the date, torch, wall time, worker count, the grids' settings, ``configs`` (each arm's base
  config, overrides, stage-1 overrides and seeds) and what the call measured besides the points
  (throughput, latency);
* ``points`` (JSON): every evaluation point's record (metrics, arm, seed, step, the code's ``commit``);
* per point ``p<i>.<name>``: the arrays the paired intervals resample (:mod:`studies.evidence`): ``val``
  (per-triple validation losses), ``fid_draws`` (the FID on the full sample set, then on each joint
  resample: what the features give, without the features), ``fid_samples`` and the per-sample scores
  (``label_correct``; on the shapes each property);
* ``images.<grid>.<arm>``: the kept samples a samples plot shows.

A runner writes one with :func:`build` (arrays read from a study folder) or :func:`make_record` (arrays
given) and :func:`save`; :func:`load` reads it back, and ``Record.samples()`` serves the arrays to
:func:`studies.evidence.compare` as the study folder's ``SampleSets`` would. The study runners render
their reports only from a record, so a table in a run folder and the same table regenerated from the
committed record are the same bytes. Plots are PNGs without a date or software version; each carries the
data it draws (lines, bands, titles, an image digest) as a text chunk, so ``--check`` compares a plot by
its data where the bytes differ (a plot's pixels depend on the matplotlib and FreeType versions).

The committed records live in ``docs/results/records/<name>/`` (``record.npz`` and what it renders);
``manifest.json`` there lists each folder, its commits and its files (the regenerate command writes only
those).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from studies.evidence import SampleSets

from mhla_gen.commands.cli import expand_path, run
from mhla_gen.errors import ConfigError
from mhla_gen.train.io import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "results" / "records"  # the committed records and what they render
RECORD_KIND = "study_record"  # the record every record.npz carries (mhla_gen.outputs.folders.file_is_ours)
RECORD_VERSION = 1
RUNNER_NAME = re.compile(r"[a-z][a-z0-9_]*")  # a runner is eval/<runner>.py, which defines render()
PER_POINT = ("val", "label_correct", "all", "count", "colour", "shape", "symmetric", "symmetry_error")
PLOT_KEY = "mhla_gen plot data"  # the PNG text chunk holding a plot's data
sys.modules.setdefault("eval_results", sys.modules[__name__])  # the runners load this file by that name


# ------------------------------------------------------------------------------------------ provenance
def code_commit() -> str:
    """The short commit of this checkout's code, ``+changes`` when tracked files other than the
    documentation (``docs/``, ``*.md``) differ from it, or ``unknown`` (no git, or not a checkout)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "--short=7", "HEAD")
        if head.returncode:
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs",
                    ":(exclude)*.md").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty else "")


def how_it_ran(meta: dict) -> str:
    """A report header's account of the call that wrote the record."""
    if meta["report_only"]:
        return "tables from the runs finished so far"
    return f"wall time of this call {meta['wall_seconds'] / 60:.0f} min, {meta['jobs']} worker processes"


def commits_line(points: list[dict]) -> str:
    """Which commit of the code computed the points: one line for all, or each commit with its arms."""
    by_commit: dict[str, dict[str, set]] = {}
    for p in points:
        by_commit.setdefault(p.get("commit", "unknown"), {}).setdefault(p["arm"], set()).add(p["seed"])
    if len(by_commit) == 1:
        return f"Code: commit `{next(iter(by_commit))}` for every point."
    parts = [f"`{c}`: " + ", ".join(f"{arm} (seeds {', '.join(map(str, sorted(seeds)))})"
                                    for arm, seeds in arms.items()) for c, arms in by_commit.items()]
    return ("Code: the points come from more than one commit, because the runner resumes (a point keeps the "
            "commit of the call that computed it; `unknown`: computed before points recorded it): "
            + "; ".join(parts) + ".")


# ------------------------------------------------------------------------------------------ the record
def point_key(p: dict) -> tuple:
    """A point's identity: where its arrays sit (a record relabelled to another step names its own with
    ``result_step``, as :class:`studies.evidence.SampleSets`)."""
    return (str(p.get("grid", "")), p["arm"], int(p["seed"]), int(p.get("result_step", p["step"])))


@dataclass
class Record:
    """A study call's record: ``meta``, ``points`` and per point the arrays of :data:`PER_POINT` and
    ``fid_draws``; ``images`` per ``(grid, arm)``."""

    meta: dict
    points: list[dict]
    arrays: list[dict[str, np.ndarray]]
    images: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)

    def samples(self) -> RecordSamples:
        return RecordSamples(self)


class RecordSamples:
    """:class:`studies.evidence.SampleSets` read from a :class:`Record`: what ``compare`` resamples."""

    def __init__(self, record: Record):
        self._index = {point_key(p): i for i, p in enumerate(record.points)}
        self._arrays = record.arrays

    def arrays(self, point: dict) -> dict | None:
        i = self._index.get(point_key(point))
        return None if i is None else self._arrays[i]

    def fid_draws(self, point: dict) -> tuple[float, np.ndarray] | None:
        arrays = self.arrays(point)
        if arrays is None or "fid_draws" not in arrays:
            return None
        return float(arrays["fid_draws"][0]), arrays["fid_draws"][1:]

    def count(self, point: dict) -> int:
        return int(self.arrays(point)["fid_samples"])


def _compact(array: np.ndarray) -> np.ndarray:
    """float64 values that float32 holds exactly (the per-triple losses are float32 sums) as float32."""
    if array.dtype == np.float64 and np.array_equal(array.astype(np.float32).astype(np.float64), array):
        return array.astype(np.float32)
    return array


def point_arrays(run_folder: Path, point: dict) -> dict[str, np.ndarray]:
    """A finished point's arrays from the study folder ``run_folder`` (its ``step<n>_features.npz``):
    the per-sample scores, the per-triple losses and the FID's joint resamples (from the sample
    features); empty where the point kept none."""
    sets = SampleSets(run_folder)
    found = sets.arrays(point)
    if found is None:
        return {}
    out = {k: _compact(np.asarray(found[k])) for k in PER_POINT if k in found}
    draws = sets.fid_draws(point)
    if draws is not None:
        out["fid_draws"] = np.concatenate([[draws[0]], draws[1]])
        out["fid_samples"] = np.array(sets.count(point))
    return out


def runner_file(runner: str) -> Path:
    """``eval/<runner>.py``, the runner that writes and renders records of that name (``ConfigError``
    for a name that is no runner of eval/)."""
    valid = RUNNER_NAME.fullmatch(str(runner)) and runner != "results"
    path = Path(__file__).with_name(f"{runner}.py") if valid else None
    if path is None or not path.is_file():
        raise ConfigError(f"runner {runner!r} is not a study runner: eval/<runner>.py must exist and "
                          "define render(record, folder)")
    return path


def make_record(runner: str, command: str, points: list[dict], arrays: list[dict[str, np.ndarray]],
                meta: dict, images: dict[tuple[str, str], np.ndarray] | None = None) -> Record:
    """A record from its parts: ``points`` (each a JSON dict with at least ``arm``, ``seed``, ``step``),
    ``arrays`` (one dict of arrays per point, ``{}`` where none: the keys of :data:`PER_POINT`,
    ``fid_draws``, ``fid_samples``, or a runner's own), ``meta`` (the runner's own: grids and their
    settings, ``configs``, measurements). The command, date, torch version, runner and record version
    are added to ``meta``."""
    runner_file(runner)
    if len(arrays) != len(points):
        raise ValueError(f"arrays: one dict per point, got {len(arrays)} for {len(points)} points")
    meta = {"runner": runner, "command": command, "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__, "version": RECORD_VERSION, **meta}
    return Record(meta, list(points), [dict(a) for a in arrays], dict(images or {}))


def build(runner: str, command: str, points: list[dict], run_folder: Path, meta: dict,
          images: dict[tuple[str, str], np.ndarray] | None = None) -> Record:
    """The record of one study call: ``points`` (its finished evaluation points) with their arrays read
    from the study folder ``run_folder`` (:func:`point_arrays`), see :func:`make_record`."""
    arrays = [point_arrays(Path(run_folder), p) for p in points]
    return make_record(runner, command, points, arrays, meta, images)


def configs(jobs) -> list[dict]:
    """The configuration of each arm of a study (``studies.experiments.Job`` list): its grid, base
    config, overrides, stage-1 overrides and seeds; what ``meta["configs"]`` records (paths inside this
    checkout relative to it, so a committed record names no machine's folders)."""
    def portable(overrides):
        return None if overrides is None else [o.replace(f"{ROOT}{os.sep}", "") for o in overrides]

    arms: dict[tuple, dict] = {}
    for job in jobs:
        key = (job.extra.get("grid", ""), job.arm)
        entry = arms.setdefault(key, {"grid": key[0], "arm": job.arm, "config": Path(job.config).name,
                                      "overrides": portable(job.overrides), "stage1": portable(job.stage1),
                                      "seeds": []})
        entry["seeds"].append(job.seed)
    return list(arms.values())


def save(record: Record, path: Path) -> None:
    """``record`` as one compressed ``.npz`` (JSON parts as UTF-8 bytes), written whole or not at all."""
    arrays = {"mhla_gen_kind": np.array(RECORD_KIND),
              "meta": _json_bytes(record.meta), "points": _json_bytes(record.points)}
    for i, found in enumerate(record.arrays):
        arrays.update({f"p{i}.{name}": value for name, value in found.items()})
    for (grid, arm), image in record.images.items():
        arrays[f"images.{grid}.{arm}"] = image
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    write_bytes(Path(path), buffer.getvalue())


def write_bytes(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temp file + ``os.replace`` (readers never see half a file), with
    the permissions of any file the user creates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _json_bytes(value) -> np.ndarray:
    return np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)


def load(path: Path) -> Record:
    """The :class:`Record` in ``path`` (``FileNotFoundError`` / ``ConfigError`` naming it otherwise: a
    missing file, another ``.npz``, a damaged or truncated one)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no record at {str(path)!r} (a study call writes OUT/record.npz)")
    try:
        with np.load(path, allow_pickle=False) as data:
            return _read_record(path, data)
    except ConfigError:
        raise
    except (zipfile.BadZipFile, ValueError, KeyError, IndexError, TypeError, EOFError, OSError) as err:
        raise ConfigError(f"{str(path)!r} is not a readable study record ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else 'damaged'})") from None


def _read_record(path: Path, data) -> Record:
    """:func:`load`'s reading of the open archive ``data``."""
    if not hasattr(data, "files"):  # a plain .npy array, not an archive
        raise ConfigError(f"{str(path)!r} is not a study record (a single array, no mhla_gen_kind)")
    if "mhla_gen_kind" not in data.files or str(data["mhla_gen_kind"]) != RECORD_KIND:
        raise ConfigError(f"{str(path)!r} is not a study record (no mhla_gen_kind {RECORD_KIND!r})")
    meta, points = (json.loads(bytes(data[k]).decode()) for k in ("meta", "points"))
    if not isinstance(meta, dict) or not isinstance(points, list):
        raise ConfigError(f"{str(path)!r}: its meta or points are not what a record holds")
    if meta.get("version") != RECORD_VERSION:
        raise ConfigError(f"{str(path)!r}: record version {meta.get('version')}, this code reads "
                          f"{RECORD_VERSION}")
    arrays: list[dict] = [{} for _ in points]
    images = {}
    for name in data.files:
        if name.startswith("p") and "." in name:
            i, key = name[1:].split(".", 1)
            arrays[int(i)][key] = data[name]
        elif name.startswith("images."):
            _, grid, arm = name.split(".", 2)
            images[(grid, arm)] = data[name]
    return Record(meta, points, arrays, images)


# ------------------------------------------------------------------------------------------ plots
def save_figure(fig, path: Path, dpi: int = 120) -> None:
    """``fig`` as a PNG with no date or software version in it, carrying :func:`figure_data` as a text
    chunk (what ``regenerate --check`` compares when a newer matplotlib draws other pixels)."""
    import matplotlib.pyplot as plt

    data = json.dumps(figure_data(fig), sort_keys=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, metadata={"Software": None, PLOT_KEY: data})
    plt.close(fig)
    write_bytes(Path(path), buffer.getvalue())


def _rounded(values) -> list:
    """Floats to 6 significant digits (what a plot can show; free of the last bits' rounding)."""
    return [None if not math.isfinite(v) else float(f"{v:.6g}") for v in np.asarray(values, float).ravel()]


def figure_data(fig) -> list[dict]:
    """Everything ``fig``'s axes draw, as plain data: titles and labels, each line's points, each band's
    outline, each image's digest and the legend's entries."""
    axes = []
    for ax in fig.axes:
        legend = ax.get_legend()
        axes.append({
            "title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
            "yscale": ax.get_yscale(),
            "lines": [{"label": line.get_label(), "x": _rounded(line.get_xdata()),
                       "y": _rounded(line.get_ydata())} for line in ax.get_lines()],
            "bands": [_rounded(path.vertices) for c in ax.collections for path in c.get_paths()],
            "images": [hashlib.sha256(np.ascontiguousarray(im.get_array()).tobytes()).hexdigest()
                       for im in ax.get_images()],
            "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
        })
    return axes


def png_data(path: Path) -> str | None:
    """The plot data a PNG of :func:`save_figure` carries (None for another PNG)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.text.get(PLOT_KEY)


# ------------------------------------------------------------------------------------------ rendering
def runner_module(runner: str):
    """The study runner ``eval/<runner>.py`` (it renders its own records: ``render(record, folder)``)."""
    name = f"eval_{runner}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, runner_file(runner))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def render(record: Record, folder: Path) -> list[Path]:
    """Every table and plot of ``record`` written into ``folder``; returns the files written."""
    return runner_module(record.meta["runner"]).render(record, Path(folder))


def same_output(new: Path, old: Path) -> str:
    """``"same"`` (identical bytes), ``"same data"`` (a plot whose pixels differ but whose data does
    not) or ``"differs"``."""
    if not old.is_file():
        return "differs"
    if new.read_bytes() == old.read_bytes():
        return "same"
    if new.suffix == ".png" and png_data(new) is not None and png_data(new) == png_data(old):
        return "same data"
    return "differs"


# ------------------------------------------------------------------------------------------ old tables
# The mark of a table measured before records were kept (its run folders are gone): its date (or dates)
# and the commit that ran it ("commit `abc1234`", or words saying the run did not record one), e.g.
# "Measured 2026-11-27 at commit `abc1234`; no record kept." A table in docs/results/ is a file a
# committed record renders, a quote of a table such a file holds (its header, and rows of that table:
# :func:`quotable_tables`), or sits in a section (or under a heading whose section) carrying this mark.
MARK = re.compile(r"measured (\d{4}-\d{2}-\d{2})(?: to \d{4}-\d{2}-\d{2})? at "
                  r"(commits? `[0-9a-f]{7,40}`[^;]*|an unrecorded commit[^;]*|the commits[^;]*); "
                  r"no record kept", re.IGNORECASE)


def tables(text: str) -> list[tuple[int, list[str]]]:
    """The Markdown tables of ``text`` outside fenced code blocks: ``(first line number (1-based),
    lines)``."""
    found, fenced, last = [], False, -1
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("|"):
            continue
        if last == number - 1:
            found[-1][1].append(line)
        else:
            found.append((number, [line]))
        last = number
    return found


def quotable_tables(texts) -> list[tuple[tuple[str, str], set[str]]]:
    """Per table of the rendered ``texts``: its header and separator lines, and its set of rows (a page
    quotes a rendered table by repeating its header and any of its rows unchanged)."""
    return [((lines[0], lines[1]), set(lines[2:])) for text in texts for _, lines in tables(text)
            if len(lines) >= 2]


def is_quote(lines: list[str], quotable) -> bool:
    return len(lines) >= 2 and any(head == (lines[0], lines[1]) and set(lines[2:]) <= rows
                                   for head, rows in quotable)


def quotes_a_header(lines: list[str], quotable) -> bool:
    return len(lines) >= 2 and any(head == (lines[0], lines[1]) for head, _ in quotable)


def unmarked_tables(text: str, quotable=(), linked=()) -> list[int]:
    """The line numbers (1-based) of Markdown tables in ``text`` that are no quote of ``quotable``
    (:func:`quotable_tables`) and that no :data:`MARK` above them covers: a mark covers the rest of its
    own section and every section nested under it (the file's first heading is its title, whose section
    encloses the whole file). A table with the header of a table in ``linked`` (those of the records
    the page links to) must be its quote, marked or not: a number changed in a quote is caught under a
    page's mark. Fenced code blocks are skipped."""
    starts = {number: lines for number, lines in tables(text)}
    sections = [(-1, False)]  # (heading level, marked), the file's start down to the current section
    unmarked, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        heading = re.match(r"(#{1,6}) ", line)
        if heading:
            level = len(heading.group(1)) if len(sections) > 1 else 0  # the title: level 0, never closed
            while sections[-1][0] >= level:
                sections.pop()
            sections.append((level, False))
        if MARK.search(line):
            sections[-1] = (sections[-1][0], True)
        if number in starts and not is_quote(starts[number], quotable) \
                and (quotes_a_header(starts[number], linked) or not any(m for _, m in sections)):
            unmarked.append(number)  # a rendered table's header with other rows: a changed quote
    return unmarked


# ------------------------------------------------------------------------------------------ the manifest
def manifest(records: Path = RECORDS) -> list[dict]:
    """The committed records: ``[{"name", "files", ...}]`` from ``records/manifest.json``."""
    path = Path(records) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"no manifest at {str(path)!r}")
    entries = json.loads(path.read_text())["records"]
    for entry in entries:
        if not (Path(records) / entry["name"] / "record.npz").is_file():
            raise FileNotFoundError(f"{path}: {entry['name']!r} has no record.npz")
    return entries


def regenerate(records: Path = RECORDS, check: bool = False, names: list[str] | None = None) -> list[str]:
    """Render every committed record (or those ``names``) and write its listed files (``check``: compare
    them instead, writing nothing); returns one line per file that differs (or was written)."""
    entries = [e for e in manifest(records) if names is None or e["name"] in names]
    if names is not None and len(entries) != len(set(names)):
        missing = sorted(set(names) - {e["name"] for e in entries})
        raise ConfigError(f"--names {' '.join(missing)}: not in {records}/manifest.json")
    report = []
    for entry in entries:
        folder = Path(records) / entry["name"]
        with tempfile.TemporaryDirectory() as tmp:
            written = {p.name: p for p in render(load(folder / "record.npz"), Path(tmp))}
            if sorted(written) != sorted(entry["files"]):
                report.append(f"{entry['name']}: renders {sorted(written)}, the manifest lists "
                              f"{sorted(entry['files'])}")
                continue
            for name, new in written.items():
                state = same_output(new, folder / name)
                if state == "differs":
                    report.append(f"{entry['name']}/{name}: " + ("differs" if check else "written"))
                    if not check:
                        shutil.copyfile(new, folder / name)
                elif state == "same data" and not check:
                    shutil.copyfile(new, folder / name)
    return report


def add(run_folder: Path, name: str, records: Path = RECORDS, example: bool = False) -> list[str]:
    """Copy ``run_folder``'s ``record.npz`` into ``records/<name>/``, render it there and list it in the
    manifest (``example``: a small record the test suite regenerates); refuses a name already listed."""
    if not RUNNER_NAME.fullmatch(name.replace("-", "_")):
        raise ConfigError(f"NAME must be lower-case letters, digits, '_' or '-', got {name!r}")
    source = Path(run_folder) / "record.npz"
    record = load(source)
    path = Path(records) / "manifest.json"
    listed = json.loads(path.read_text()) if path.is_file() else {"records": []}
    if any(e["name"] == name for e in listed["records"]) or (Path(records) / name).exists():
        raise ConfigError(f"NAME {name!r} is taken in {records}: choose another")
    runner_file(record.meta.get("runner"))  # a record no runner renders is refused before the folder is made
    folder = Path(records) / name
    folder.mkdir(parents=True)
    try:
        shutil.copyfile(source, folder / "record.npz")
        files = sorted(p.name for p in render(record, folder))
    except BaseException:  # the folder made just now, not listed: gone again, so NAME stays free
        shutil.rmtree(folder)
        raise
    commits = sorted({p.get("commit", "unknown") for p in record.points})
    listed["records"].append({"name": name, "runner": record.meta["runner"], "date": record.meta["date"],
                              "commits": commits, "command": record.meta["command"], "files": files,
                              **({"example": True} if example else {})})
    atomic_write_text(path, json.dumps(listed, indent=1) + "\n")
    return [f"{name}/{f}" for f in files]


def check_render_target(out: Path) -> None:
    """``render --out``: a new or empty folder (a record's files never land among a user's)."""
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise ConfigError(f"--out {str(out)!r} is not a new or empty folder: give one")


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    again = commands.add_parser("regenerate", help="every committed table and plot from its record")
    again.add_argument("--check", action="store_true", help="compare, write nothing; exit 1 if any differs")
    again.add_argument("--names", nargs="+", default=None, help="only these records of the manifest")
    again.add_argument("--records", type=expand_path, default=str(RECORDS), help=argparse.SUPPRESS)
    one = commands.add_parser("render", help="one record's tables and plots into a folder")
    one.add_argument("record", type=expand_path)
    one.add_argument("--out", type=expand_path, required=True)
    new = commands.add_parser("add", help="a study folder's record into docs/results/records/NAME")
    new.add_argument("run_folder", type=expand_path)
    new.add_argument("name")
    new.add_argument("--example", action="store_true", help="a small record the test suite regenerates")
    new.add_argument("--records", type=expand_path, default=str(RECORDS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command == "render":
        check_render_target(Path(args.out))
        lines = [str(p) for p in render(load(Path(args.record)), Path(args.out))]
    elif args.command == "add":
        lines = add(Path(args.run_folder), args.name, Path(args.records), args.example)
    else:
        lines = regenerate(Path(args.records), args.check, args.names)
        if args.check and lines:
            print("\n".join(lines))
            raise SystemExit(1)
    print("\n".join(lines) if lines else "every table and plot is as its record renders it")
    return lines


if __name__ == "__main__":
    run(main)
