"""MHLA against softmax and linear attention where N ≫ M², on one GPU, at equal images and equal compute.

    python eval/scale_study.py --sizing-only --sizing OUT/sizing.json          # ~30 s: images/s per arm, N
    python eval/scale_study.py --sizing OUT/sizing.json --seconds 100 --export OUT/scale_study
    python eval/scale_study.py --images 16384 --export OUT/scale_study         # a budget in images instead
    python eval/results.py render OUT/scale_study/record.npz --out TABLES      # the tables from the record
    python eval/scale_study.py --smoke --out /tmp/s                            # CPU, a minute: the plumbing

eval/study.py answered MHLA against softmax at N = M² (256 tokens, 4x4 blocks). Here the drawn shapes
(mhla_gen.data.shapes) are 64x64 and 128x128 pixels, patch 2: 1024 and 4096 tokens with 4x4 blocks, so
N = 4 M² and 16 M². The arms are eval/study.py's: ``softmax`` (SDPA, FlashAttention on a GPU), ``mhla``
(the registered op: Triton on CUDA) and ``linear`` (MHLA with one block). The model is one the GPU runs
efficiently: DiT with hidden 256, depth 8, 4 heads of 64, bf16 autocast (the CPU smoke too); the shapes'
recipe (studies.experiments.SHAPES_RECIPE) as in every shapes study.

Budgets. The softmax arm (the reference) trains ``--images`` images per grid, or as many as fit
``--seconds`` of the device per grid given ``--sizing`` (training and forward images/s per arm and N,
measured by ``--sizing-only``), after every run's evaluations (validation losses and samples, counted from
the forward speed: studies.scale_preset.eval_seconds). Every arm is evaluated at the same log-spaced image
counts (the reference's budget halved ``--points - 1`` times: equal images) and trains on to the steps at
which it has spent the reference's training FLOPs at each of them (equal compute; FLOPs of a training step
counted by mhla_gen.metrics.flops, so MHLA and linear attention train more images than softmax for the
same compute). ``--compute time`` matches measured seconds (``--sizing``) instead of FLOPs. Samples are
drawn and scored only at the two end points (equal images, equal compute); the validation loss is measured
at every point.

Seeds run concurrently: every (arm, seed) run of a grid is its own process (``--jobs``, default all of a
grid's runs at once), sharing the GPU. Separate processes rather than one batched model: each run is the
project's own training loop (mhla_gen.train.loop, Accelerate) and evaluation, unchanged; a batched model
(torch.func.vmap over stacked weights) would need a vmap rule for the registered MHLA op and its own
loop. Processes share the device by time slices, and each hides the others' host work (a small model's
kernel launches), which a single process of a model this size leaves idle.

Decision. One primary metric, declared before any run (2026-11-28): the validation loss (1024 fixed
held-out triples) at the end of the budget at equal compute, the question MHLA's cost is for. At a few
minutes of one GPU the properties sit at their floor in every arm (the 256-token runs drew none before
step 1200), so a rate would read "neither"; the validation loss decides at any budget. Secondaries under
Holm's rule: the validation loss at equal images, the FID and the shapes' properties at both end points.

Records: ``--out`` holds the runs (checkpoints: large), their record ``record.npz`` (eval/results.py: the
points' metrics, commit, per-triple losses and per-sample scores; the sizing and the plan in its meta) and
``scale_study.md`` rendered from it, after each grid; ``--export DIR`` writes the same two files into
``DIR`` too (a few MB: what comes back from a GPU machine and is committed), and ``python eval/results.py
render DIR/record.npz`` renders the tables again from the record alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from studies import sibling
from studies.evidence import check_questions
from studies.experiments import VAL_TRIPLES, finished_points, make_jobs, run_jobs
from studies.scale_preset import ARMS, CONFIG, GRIDS, base_overrides, grid_plan
from studies.scale_report import PRIMARY, QUESTIONS, report
from studies.scale_sizing import device_name, load_sizing, read_sizing, sizing, sizing_table

from mhla_gen.commands.cli import device_setting, expand_path, run
from mhla_gen.errors import ConfigError
from mhla_gen.ops.triton_probe import triton_importable
from mhla_gen.train.io import atomic_write_text

results = sibling("results")  # the record every table is rendered from

REPORT = "scale_study.md"  # the tables, rendered from record.npz beside them
REPORT_MARK = "<!-- mhla_gen: scale-study report -->"  # the report's first line: ours to replace
RECORD = "record.npz"
PRECISION_NAMES = {"no": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}  # train.mixed_precision


# ------------------------------------------------------------------------------------------ runs
def plan_jobs(args, plans: dict[str, dict]) -> dict[str, list]:
    """Every (arm, seed) run of each grid, evaluated at its equal-images and equal-compute steps."""
    jobs = {}
    seeds, commit = list(range(args.first_seed, args.first_seed + args.seeds)), results.code_commit()
    for name, p in plans.items():
        grid, jobs[name] = GRIDS[name], []
        for arm in ARMS:
            own = p["compute_steps"][arm.name]
            extra = {"grid": name, "tokens": p["tokens"], "blocks": list(grid["blocks"]),
                     "images_steps": p["images_steps"], "compute_steps": own,  # FLOPs: the point's own
                     "commit": commit}
            warmup = min(50, max(1, p["images_steps"][-1] // 10))  # every arm alike, whatever its budget
            base = base_overrides(grid, args.precision, warmup)
            found = make_jobs(args.out / name, CONFIG, base, [arm], seeds, sorted({*p["images_steps"], *own}),
                              grid["fid_samples"], extra, grid.get("val_triples", VAL_TRIPLES))
            for job in found:
                job.device, job.attention_stats = args.device, False
                job.sample_at = [p["images_steps"][-1], own[-1]]
                job.checkpoint_every = max(job.steps)  # a checkpoint at each segment's end only
            jobs[name] += found
    return jobs


# ------------------------------------------------------------------------------------------ records
def render(record, folder: Path) -> list[Path]:
    """``scale_study.md`` of a scale-study record (eval/results.py) in ``folder``, from the record alone."""
    meta = record.meta
    heading = (f"# MHLA / softmax / linear where N ≫ M²\n\n`{meta['command']}` — {meta['date']}, "
               f"{meta['device']} ({PRECISION_NAMES.get(meta['precision'], meta['precision'])}), "
               f"{results.how_it_ran(meta)}, "
               f"torch {meta['torch']}\n\n{results.commits_line(record.points)}\n{status_lines(meta)}")
    path = Path(folder) / REPORT
    text = report(record.points, record.samples(), heading, meta.get("sizing"), meta.get("jobs"))
    atomic_write_text(path, f"{REPORT_MARK}\n{text}")
    return [path]


def status_lines(meta: dict) -> str:
    """The heading's lines on what did not run: grids left out when planned (``meta["skipped"]``) and a
    study stopped before its end (``meta["stopped"]``); empty for a whole study."""
    lines = [f"\nGrid {name} was not run: {why}\n" for name, why in (meta.get("skipped") or {}).items()]
    if meta.get("stopped"):
        lines.append(f"\nStopped early (a run failed or the time ran out) in {meta['stopped']}: its tables "
                     "hold every point finished by then, those of runs cut short included (the seeds "
                     "columns count each cell's runs).\n")
    return "".join(lines)


def write_record(args, records: list[dict], meta: dict, seconds: float) -> str:
    """The record of the points so far (``record.npz``) and the report rendered from it, in ``--out`` and
    in ``--export``; returns the report."""
    meta = {**meta, "report_only": False, "wall_seconds": seconds}
    record = results.build("scale_study", args.command, records, args.out, meta)
    for folder in filter(None, (args.out, args.export)):
        results.save(record, Path(folder) / RECORD)
        render(results.load(Path(folder) / RECORD), Path(folder))  # as regenerating from the file does
    return (Path(args.out) / REPORT).read_text()


# ------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=expand_path, default=None,
                        help="the runs (large; default: a new temporary folder, the records go to --export)")
    parser.add_argument("--export", type=expand_path, default=None, metavar="DIR",
                        help="write record.npz and scale_study.md into DIR too (the compact part of --out)")
    parser.add_argument("--grids", nargs="+", choices=["1024", "4096"], default=["4096", "1024"],
                        help="the grids in the order they run (default: 4096 tokens, the study's point, "
                             "first; --sizing-only measures them in this order)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--images", type=int, default=None, help="the reference arm's images per grid")
    parser.add_argument("--seconds", type=float, default=None,
                        help="device seconds per grid, training and evaluations (with --sizing): sets "
                             "--images")
    parser.add_argument("--sizing", type=expand_path, default=None, help="a --sizing-only file")
    parser.add_argument("--sizing-only", action="store_true", help="measure images/s into --sizing; no runs")
    parser.add_argument("--sizing-seconds", type=float, default=3.0, help="timing per arm and grid")
    parser.add_argument("--compute", choices=["flops", "time"], default="flops",
                        help="equal compute in counted FLOPs, or in measured seconds (--sizing)")
    parser.add_argument("--points", type=int, default=4, help="log-spaced evaluation points (factor 2)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at once (default: all of a grid's)")
    parser.add_argument("--device", default=None, help="default cuda (the smoke: cpu)")
    parser.add_argument("--smoke", action="store_true", help="CPU, seconds: a tiny model, one seed")
    args = parser.parse_args(argv)
    if args.smoke:
        args.grids, args.seeds, args.points = ["smoke"], min(args.seeds, 1), 2
        args.device, args.jobs = args.device or "cpu", 1 if args.jobs is None else args.jobs
    args.device = args.device or "cuda"
    args.out = Path(args.out) if args.out else None
    check_args(args)
    # bf16 autocast as on the GPU; the smoke too, so that the CPU runs the real run's precision plumbing
    args.precision = "bf16" if torch.device(args.device).type == "cuda" or args.smoke else "no"
    return args


def check_args(args) -> None:
    """Every refusal before any work."""
    for name in ("seeds", "points", "jobs", "images", "seconds"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.first_seed < 0:
        raise ConfigError(f"--first-seed must be >= 0, got {args.first_seed}")
    if args.sizing_only and args.sizing is None:
        raise ConfigError("--sizing-only writes its measurements to --sizing FILE: give one")
    if args.sizing_only or args.smoke:
        pass
    elif args.images is None and args.seconds is None:
        raise ConfigError("give a budget: --images N, or --seconds S with --sizing FILE")
    elif (args.seconds is not None or args.compute == "time") and args.sizing is None:
        raise ConfigError("--seconds and --compute time read measured images/s: give --sizing FILE")
    check_device(device_setting(args.device, hint="--smoke runs the plumbing on CPU"), args.device)
    if args.export is not None:
        check_export(Path(args.export))
    check_questions(QUESTIONS, (PRIMARY,), "eval/scale_study.py")


def check_device(device: torch.device, given: str) -> None:
    """The study runs where its training runs. Accelerate trains on GPU 0 (choose another with
    ``CUDA_VISIBLE_DEVICES``), so another index is refused; the mhla and linear arms are the Triton kernels'
    on CUDA, so a CUDA run without Triton (the op would fall back to PyTorch without a word, and the study
    would time other kernels) is refused too."""
    if device.type == "cuda" and device.index not in (None, 0):
        raise ConfigError(f"--device {given}: the runs train on GPU 0 (Accelerate's); choose the GPU with "
                          f"CUDA_VISIBLE_DEVICES={device.index} and --device cuda")
    if device.type == "cuda" and not triton_importable():
        raise ConfigError(f"--device {given}: the mhla and linear arms run the Triton kernels on CUDA, and "
                          "triton does not import here; install it (it comes with torch's CUDA wheels)")


def check_export(folder: Path) -> None:
    """``--export`` may be new, or hold only this script's files (a record and a report of ours)."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--export {str(folder)!r} is a file; give a folder")
    if (folder / RECORD).exists():
        try:
            runner = results.load(folder / RECORD).meta.get("runner")
        except (ConfigError, ValueError, OSError) as err:
            raise ConfigError(f"--export {str(folder)!r}: {RECORD} there is not a record of ours ({err}); "
                              "nothing was changed: choose another folder") from None
        if runner != "scale_study":
            raise ConfigError(f"--export {str(folder)!r}: {RECORD} there is a record of eval/{runner}.py, "
                              "not of this script; nothing was changed: choose another folder")
    report = folder / REPORT
    if report.exists() and report.read_text(errors="replace").split("\n", 1)[0] != REPORT_MARK:
        raise ConfigError(f"--export {str(folder)!r}: {str(report)!r} exists and was not written by this "
                          "script; nothing was changed: choose another folder")


def write_sizing(args) -> dict:
    path = Path(args.sizing)
    if path.exists():
        load_sizing(path)  # ConfigError for a file that is not one (a user's file is never replaced)
    def write(measured: dict) -> None:  # after every row: a later row that fails keeps the ones before it
        atomic_write_text(path, json.dumps(measured, indent=1))

    measured = sizing(args.grids, args.device, args.precision, args.sizing_seconds, write)
    print(sizing_table(measured))
    return measured


def plan_grids(args) -> tuple[dict[str, dict], dict[str, str]]:
    """``(plans, skipped)``: each grid's plan (:func:`studies.scale_preset.grid_plan`), made on its own.
    A grid that cannot be planned (its rows missing from ``--sizing``, or ``--seconds`` too short for its
    evaluations) is left out, its reason in ``skipped[grid]`` and in the log, and the other grids run;
    ``ConfigError`` naming every reason when no grid can run."""
    plans, skipped = {}, {}
    for name in args.grids:
        try:
            speed = read_sizing(Path(args.sizing), [name]) if args.sizing else None
            infer = read_sizing(Path(args.sizing), [name], "infer_images_per_s") if args.seconds else None
            plans[name] = grid_plan(name, args, speed, infer)
        except ValueError as err:  # ConfigError is one
            skipped[name] = str(err)
            logging.warning("grid %s is not run: %s", name, err)
    if not plans:
        raise ConfigError("no grid can run: " + "; ".join(f"grid {n}: {why}" for n, why in skipped.items()))
    return plans, skipped


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    if args.sizing_only:
        write_sizing(args)
        return []
    measured = None
    if args.sizing:  # a missing file, or one not a sizing file, is refused outright (not per grid)
        read_sizing(Path(args.sizing), [])
        measured = load_sizing(Path(args.sizing))
    plans, skipped = plan_grids(args)
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="mhla_scale_study_"))
        logging.info("runs in %s", args.out)
    jobs = plan_jobs(args, plans)
    args.command = "python eval/scale_study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    every = [job for name in plans for job in jobs[name]]
    meta = {"grids": list(plans), "skipped": skipped, "plans": plans, "sizing": measured,
            "device": device_name(args.device), "precision": args.precision,
            "configs": results.configs(every),
            "mhla_backend": "triton" if torch.device(args.device).type == "cuda" else "pytorch",
            "jobs": args.jobs or max(len(jobs[name]) for name in plans)}
    start = time.perf_counter()
    with training_on(args.device):
        records = run_grids(args, jobs, meta, start)
    print(write_record(args, records, meta, time.perf_counter() - start))
    for name, why in skipped.items():  # the report's heading says it too; here it is the last word
        logging.warning("grid %s was not run: %s", name, why)
    return records


def run_grids(args, jobs: dict[str, list], meta: dict, start: float) -> list[dict]:
    """Every planned grid's runs in turn (``--grids`` order), the record written after each; when a run
    fails or the time runs out (Ctrl-C), the record of every evaluation point finished so far (those of
    runs cut short included: ``meta["stopped"]`` says so) is written before the error is raised."""
    records, names = [], list(jobs)
    for name in names:
        logging.info("grid %s: %s", name, json.dumps(meta["plans"][name]))
        try:
            records += run_jobs(args.out, "study", "--out", jobs[name], args.jobs or len(jobs[name]),
                                "scale_study")
        except BaseException:  # a run failed or the time ran out: keep every point finished so far
            finished = records + finished_points(jobs[name])
            if finished:
                write_record(args, finished, {**meta, "stopped": f"grid {name}"}, time.perf_counter() - start)
            raise
        if name != names[-1]:
            write_record(args, records, meta, time.perf_counter() - start)
    return records


# The CUDA allocator of every run's process: runs sharing one GPU each grow and shrink their activations;
# expandable segments map more memory into a segment instead of caching fixed ones, so one process's
# freed blocks fragment less of what the others need. A user's own setting is kept.
CUDA_ALLOC_CONF = "expandable_segments:True"


def training_on(device: str):
    """The environment the runs' processes inherit, restored after. Runs that evaluate on the CPU train
    there too: Accelerate puts training on a GPU wherever there is one unless ``ACCELERATE_USE_CPU`` says
    otherwise. Runs on CUDA get ``PYTORCH_CUDA_ALLOC_CONF`` :data:`CUDA_ALLOC_CONF` unless it is set."""
    kind = torch.device(device).type
    env = {"ACCELERATE_USE_CPU": "true"} if kind == "cpu" else {}
    if kind == "cuda" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        env["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF
    return mock.patch.dict(os.environ, env)


if __name__ == "__main__":
    run(main)
