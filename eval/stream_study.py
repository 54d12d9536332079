"""Streaming past the training length on moving shapes: softmax with a KV cache, one global state, MHLA with
the general and the factorised mixing (issue 58; the test bed is ``eval/stream_bed.py``).

    python eval/stream_study.py --out runs/stream                 # 4 arms x 3 seeds, costs, report
    python eval/stream_study.py --out runs/stream --stage report  # the tables from the records alone
    python eval/stream_study.py --out runs/stream_smoke --size smoke   # seconds: the plumbing

Stages (each resumable: a finished record is kept and skipped; a folder holds one size, so a command whose
size flags differ from those that made its files is refused before it writes):

* ``train``: per (seed, arm), seeds outermost so an interrupted run holds whole seeds: diffusion forcing
  from scratch (its state kept every ``--checkpoint-every`` steps in ``training/``: a killed run continues
  exactly where it was kept), then ``eval_clips`` videos streamed from the same noise and classes in every
  arm and seed (common random numbers) to 8x the training length (the general mixing: the training length,
  its ``W`` stops there), scored frame by frame (``records/<arm>_seed<k>.npz``);
* ``costs``: per arm, one video of 8x the training length streamed at batch 1 with untrained weights
  (memory and time are properties of the memory, not of what it learnt; the general mixing built for that
  length): seconds, cache bytes and peak allocated bytes per chunk (``costs.json``);
* ``report``: ``record.npz`` (every (arm, seed) record and the costs in one study record of
  ``eval/results.py``: what the page's numbers come from), and rendered from it alone ``streaming.md``
  (tables, verdicts) and ``streaming_curves.png``; ``python eval/results.py add OUT NAME`` commits it.

The questions (``stream_report.QUESTIONS``; the rules of docs/evaluation.md "Verdicts": 3 seeds, one primary,
Holm over the secondaries, a minimum effect of 0.05 in a rate, "neither" when both arms sit at the floor
0.02): the score of a clip over a window of frames is the share of its frames that pass the question's
check of the scorer; windows ``1x`` = frames ``[0, F)``, ``8x`` = ``[0, 8F)``, ``last`` = ``[7F, 8F)``.
Declared 2026-11-29, before any MHLA arm of the 6000-step run (the runs of 2026-11-28 asked the same on
``all``, which no arm passes after frame 1 at 6000 steps: their records render with those questions):

* primary: ``mhla-factorised − global-state``, ``colour`` over the 8x window (per-block memory against one
  global state: does the video stay on its class past the training length?);
* secondaries, on ``colour``: ``mhla-factorised − softmax-kv`` at 8x and at 1x, ``mhla-factorised −
  global-state`` at 1x, ``mhla-general − mhla-factorised`` at 1x, and per streaming arm the decay with
  distance from the start (1x minus ``last``); and the primary of 2026-11-28, ``all`` at 8x.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import pickle
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the test bed beside this script (eval/ is not a package)
    sys.path.insert(0, str(HERE))

import stream_bed as bed  # noqa: E402
import stream_report as report  # noqa: E402
from studies import sibling  # noqa: E402
from studies.folders import claim_study  # noqa: E402

from mhla_gen.commands.cli import device_setting  # noqa: E402
from mhla_gen.errors import ConfigError  # noqa: E402
from mhla_gen.outputs.folders import FILE_RECORD, file_is_ours  # noqa: E402
from mhla_gen.train.io import atomic_write_text  # noqa: E402

results = sibling("results")  # the study record this script writes and renders from
KIND = bed.KIND
STAGES = ("all", "train", "costs", "report")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the study folder (made, or one this script made)")
    p.add_argument("--size", default="main", choices=sorted(bed.SIZES))
    p.add_argument("--stage", default="all", choices=STAGES)
    p.add_argument("--arms", nargs="+", default=list(bed.ARMS))
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--steps", type=int, help="training steps (default: the size's)")
    p.add_argument("--eval-clips", type=int, help="streamed videos per (arm, seed) (default: the size's)")
    p.add_argument("--batch", type=int, help="training batch (default: the size's)")
    p.add_argument("--device", default="cpu", help="where to train, stream and measure (cpu, cuda)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--checkpoint-every", type=int, default=250,
                   help="keep each run's training state every N steps (0: never); a killed run resumes there")
    args = p.parse_args(argv)
    unknown = sorted(set(args.arms) - set(bed.ARMS))
    if unknown:
        raise ConfigError(f"--arms: unknown {unknown}; choose from {list(bed.ARMS)}")
    for name in ("seeds", "steps", "eval_clips", "batch", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every must be >= 0 (0: never), got {args.checkpoint_every}")
    device_setting(args.device, hint="--device cpu runs on the CPU")
    return args


def study_size(args) -> bed.Size:
    size = bed.SIZES[args.size]
    given = (("steps", args.steps), ("eval_clips", args.eval_clips), ("batch", args.batch))
    changes = {k: v for k, v in given if v is not None}
    return replace(size, warmup=min(size.warmup, changes.get("steps", size.steps)), **changes)


# ------------------------------------------------------------------------------------------ records
def save_npz(path: Path, **arrays) -> None:
    """A compressed ``.npz`` of ours (the folder record inside), written whole or not at all."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **{FILE_RECORD + "_kind": np.array(KIND)}, **arrays)
    results.write_bytes(path, buffer.getvalue())


def train_point(out: Path, size: bed.Size, arm: str, seed: int, data, device: str, every: int) -> None:
    """Train ``arm`` with ``seed`` (its state kept every ``every`` steps; the last one stays beside the
    record), stream and score its videos: ``records/<arm>_seed<seed>.npz``."""
    state = bed.state_path(out, arm, seed)
    model, log = bed.train_arm(size, arm, seed, *data, device=device, resume=bed.Resume(state, every))
    labels = bed.eval_labels(size)
    start = time.perf_counter()
    videos = bed.stream(model, size, labels, bed.streamed_frames(size, arm))
    stream_seconds = time.perf_counter() - start
    scores = bed.score_videos(videos, labels)
    save_npz(bed.record_path(out, arm, seed), labels=labels.numpy(), **{k: scores[k] for k in bed.CHECKS},
             position_error=scores["position_error"].astype(np.float32),
             loss_steps=np.array([r["step"] for r in log]), loss=np.array([r["loss"] for r in log]),
             train_seconds=np.array(log[-1]["seconds"]), stream_seconds=np.array(stream_seconds),
             size=np.array(json.dumps(asdict(size))), commit=np.array(results.code_commit()))
    print(f"{arm} seed {seed}: loss {log[-1]['loss']:.4f}, train {log[-1]['seconds']:.0f} s"
          f"{steady_step_time(log)}, stream {stream_seconds:.0f} s, all {scores['all'].mean():.3f}, count "
          f"{scores['count'].mean():.3f}, colour {scores['colour'].mean():.3f}", flush=True)


def steady_step_time(log: list[dict]) -> str:
    """`` (0.123 s a step after step 25)``: seconds per step between the first and the last log entries,
    which leaves out the first steps' one-time costs (CUDA start, kernel compiles, the allocator's growth),
    the number that sizes a longer run; empty with fewer than two entries."""
    if len(log) < 2 or log[-1]["step"] == log[0]["step"]:
        return ""
    per_step = (log[-1]["seconds"] - log[0]["seconds"]) / (log[-1]["step"] - log[0]["step"])
    return f" ({per_step:.3f} s a step after step {log[0]['step']})"


def train_stage(out: Path, size: bed.Size, arms, seeds: int, device: str, every: int) -> None:
    data = None
    for seed in range(seeds):
        for arm in arms:
            if file_is_ours(bed.record_path(out, arm, seed), KIND):
                continue
            data = data if data is not None else bed.training_clips(size)
            train_point(out, size, arm, seed, data, device, every)


def costs_stage(out: Path, size: bed.Size, arms, device: str) -> None:
    """``costs.json``: per arm, :func:`bed.chunk_costs` of one untrained video of 8x the training length."""
    path, found = out / "costs.json", {}
    if path.is_file() and file_is_ours(path, KIND):
        found = json.loads(path.read_text())["arms"]
    for arm in arms:
        if arm in found:
            continue
        model = bed.build_model(size, arm, seed=0, frames=size.longest, device=device).eval()
        found[arm] = bed.chunk_costs(model, size, size.longest)
        last = found[arm][-1]
        print(f"{arm}: peak {last['peak_bytes'] / 1024:.0f} KiB at chunk {len(found[arm])}", flush=True)
        atomic_write_text(path, json.dumps({FILE_RECORD: {"kind": KIND}, "size": asdict(size), "arms": found},
                                                 indent=1) + "\n")


def study_record(records: dict, costs: dict, size: bed.Size, command: str):
    """The study's :class:`results.Record`: one point per finished (arm, seed) with its arrays (per-frame
    checks, position errors, labels, training log, seconds), the size and the costs in ``meta``."""
    points, arrays = [], []
    for arm, per_seed in records.items():
        for seed, found in per_seed.items():
            commit = str(found["commit"]) if "commit" in found else "unknown"  # older records kept none
            points.append({"arm": arm, "seed": int(seed), "step": int(found["loss_steps"][-1]),
                           "commit": commit})
            arrays.append({k: v for k, v in found.items() if k != "commit" and not k.startswith("mhla_gen")})
    meta = {"size": asdict(size), "costs": costs, "questions": report.QUESTIONS}
    return results.make_record("stream_study", command, points, arrays, meta)


def render(record, folder: Path) -> list[Path]:
    """``streaming.md`` and ``streaming_curves.png`` from ``record`` alone (``eval/results.py`` renders
    every committed record through this); returns the files written."""
    records: dict[str, dict[int, dict]] = {}
    for point, arrays in zip(record.points, record.arrays):
        records.setdefault(point["arm"], {})[int(point["seed"])] = arrays
    size = bed.Size(**{**record.meta["size"], "lengths": tuple(record.meta["size"]["lengths"])})
    asked = record.meta.get("questions", report.QUESTIONS_2026_11_28)  # the questions the run declared
    text = report.page(records, record.meta["costs"], size, record.meta["command"], record.meta["date"],
                       results.commits_line(record.points), asked)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "streaming.md", text)
    report.plot_curves(records, size, folder / "streaming_curves.png", report.curve_checks(asked))
    return [folder / "streaming.md", folder / "streaming_curves.png"]


def report_stage(out: Path, size: bed.Size, arms, seeds: int, command: str) -> None:
    """``record.npz`` from the finished records and costs; ``streaming.md`` and ``streaming_curves.png``
    rendered from it (as regenerating the committed record renders them)."""
    records = report.load_records(out, arms, seeds)
    costs = json.loads((out / "costs.json").read_text())["arms"] if (out / "costs.json").is_file() else {}
    results.save(study_record(records, costs, size, command), out / "record.npz")
    render(results.load(out / "record.npz"), out)
    print(f"wrote {out / 'streaming.md'}")


def made_at(path: Path) -> dict | None:
    """The size (``asdict``) that made ``path`` if it is one of ours (a record, a kept training state or
    ``costs.json``) and names it (the costs of 2026-11-28 do not); None otherwise."""
    if path.suffix == ".pt":  # the state keeps repr(Size): "Size(frames=4, ..., lengths=(1, 2, 4, 8))"
        try:
            # mmap: only the pickled header is read here, not the weights
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (OSError, RuntimeError, pickle.UnpicklingError, EOFError):
            return None  # not a state of ours (the training refuses it where it would resume from it)
        if not isinstance(state, dict) or state.get("kind") != KIND:
            return None
        call = ast.parse(state["size"], mode="eval").body
        return json.loads(json.dumps({kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}))
    if not file_is_ours(path, KIND):
        return None
    if path.suffix == ".npz":
        with np.load(path) as data:
            return json.loads(str(data["size"])) if "size" in data.files else None
    return json.loads(path.read_text()).get("size")


def check_folder_size(out: Path, size: bed.Size) -> None:
    """Everything already in ``out`` (records, kept states, costs) was made at ``size``: a command with other
    size flags is refused before it writes, for it would put two sizes in one table or label records with a
    size they were not trained at."""
    wanted = json.loads(json.dumps(asdict(size)))  # tuples as lists, as the files keep them
    found = [*sorted((out / "records").glob("*.npz")), *sorted((out / "training").glob("*.pt")),
             out / "costs.json"]
    for path in (p for p in found if p.is_file()):
        made = made_at(path) or wanted
        differ = sorted(k for k in wanted if made.get(k) != wanted[k])
        if differ:
            was = ", ".join(f"{k}={made.get(k)}" for k in differ)
            asked = ", ".join(f"{k}={wanted[k]}" for k in differ)
            raise ConfigError(f"--out {str(out)!r}: {path.relative_to(out)} was made with {was}; this "
                              f"command asks {asked}; pass the flags that made the folder (--size, --steps, "
                              "--batch, --eval-clips), or a new --out")


def check_report_input(args) -> None:
    """``--stage report`` reads finished records: refuse a folder without one before anything is written."""
    finished = (bed.record_path(Path(args.out), arm, seed) for arm in args.arms for seed in range(args.seeds))
    if args.stage == "report" and not any(file_is_ours(path, KIND) for path in finished):
        raise ConfigError(f"--stage report: {args.out!r} holds no finished record of --arms "
                          f"{' '.join(args.arms)} (seeds 0-{args.seeds - 1}); --stage train makes them")


def main(argv=None) -> None:
    args = parse_args(argv)
    size = study_size(args)
    check_report_input(args)
    check_folder_size(Path(args.out), size)
    out = claim_study(Path(args.out), "stream_study")
    torch.set_num_threads(args.threads)
    if args.stage in ("all", "train"):
        train_stage(out, size, args.arms, args.seeds, args.device, args.checkpoint_every)
    if args.stage in ("all", "costs"):
        costs_stage(out, size, args.arms, args.device)
    if args.stage in ("all", "report"):
        command = " ".join(["python eval/stream_study.py", *(sys.argv[1:] if argv is None else argv)])
        report_stage(out, size, args.arms, args.seeds, command)


if __name__ == "__main__":
    from mhla_gen.commands.cli import run

    run(main)
