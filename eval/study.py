"""Softmax vs linear vs MHLA attention on the embedded digits, with seeds, two grid sizes, learning
curves and the paper's MHLA ablations; tables and plots for the README.

    python eval/study.py                              # both grids, 3 seeds, ablations (see --help)
    python eval/study.py --grids 256 --seeds 5 --jobs 2
    python eval/study.py --data shapes --grids 256    # the drawn shapes (content at 256 / 1024 tokens)
    python eval/study.py --quick                      # CI-sized: about 10 min of 2 cores
    python eval/study.py --smoke                      # seconds: a smoke test of the whole pipeline

Every arm is one DiT of the same size trained with the same data, budget and seeds by
``mhla_gen.train.loop.train`` (configs/dit_digits.yaml + the overrides below); only the attention (or
one MHLA setting, for the ablations) differs. "linear" is MHLA with one block: global ReLU linear
attention, as SANA's. Grids:

* ``64``: 16x16 px digits, patch 2 -> an 8x8 token grid, MHLA blocks 2x2 (4 blocks of 16 tokens);
* ``256``: 32x32 px digits, patch 2 -> a 16x16 token grid, MHLA blocks 4x4 (16 blocks of 16 tokens,
  the paper's DiT-S/2 setting).

Each (arm, seed) is evaluated at 1/4, 1/2 and all of the budget (FID of samples drawn from the same
noise and labels in every arm and seed, with its bootstrap spread; label accuracy; the shapes' exact
properties; the validation loss on fixed held-out triples; training loss; attention rank / entropy;
studies.evidence), through ``studies.experiments`` (the
runner shared with eval/adaptation.py: resumable, parallel). Ablations (256 tokens, against plain MHLA
with the same seeds): uniform vs locality mixing init, fixed vs learnable mixing (paper Tab. 7a), CPE
and the output gate (App. F.2). Throughput of the three attentions is timed separately, side by side in
one process, at 64, 256 and 1024 tokens.

Writes OUT/record.npz (the record every table and plot is rendered from: eval/results.py), OUT/study.md
(tables), OUT/study.json (every point), OUT/curves_<grid>.png and OUT/samples_<grid>.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from studies import sibling
from studies.evidence import BUCKETS, check_questions
from studies.experiments import VAL_TRIPLES, Arm, make_jobs, study_records
from studies.study_plots import kept_samples
from studies.study_preset import (
    ABLATIONS,
    CONFIG,
    GRIDS,
    MAIN_ARMS,
    MODEL,  # noqa: F401
    NAMED_ONLY,
    base_overrides,
    check_blocks,
    grid_key,
    grid_model,
    throughput,
    with_layers,
)
from studies.study_report import PRIMARY, SECONDARY, bucket_table, questions, render  # noqa: F401

from mhla_gen.commands.cli import expand_path, run
from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import file_record
from mhla_gen.train.io import atomic_write_text

# the names marked F401 above are unused here: tests/test_eval_study.py reads them as this script's

results = sibling("results")  # the record this study renders from


def eval_steps(steps: int) -> list[int]:
    return sorted({max(1, steps // 4), max(1, steps // 2), steps})


def plan(args) -> list:
    """Every job of the study (both grids, all arms and seeds)."""
    jobs = []
    for name in args.grids:
        chosen = {"steps": args.steps, "fid_samples": args.fid_samples, "val_triples": args.val_triples}
        grid = dict(GRIDS[name], **{k: v for k, v in chosen.items() if v})
        model = grid_model(grid)
        base, seeds = base_overrides(grid, model), list(range(args.first_seed, args.first_seed + args.seeds))
        extra = {"grid": name, "tokens": (grid["resolution"] // model["patch_size"]) ** 2,
                 "commit": results.code_commit()}
        arms = [next(a for a in MAIN_ARMS if a.name == n) for n in args.arms]
        steps = sorted({*args.eval_steps, grid["steps"]}) if args.eval_steps else eval_steps(grid["steps"])
        if steps[-1] > grid["steps"]:
            raise ConfigError(f"--eval-steps {steps[-1]} is past the budget of --grids {name} "
                              f"({grid['steps']} steps; --steps sets it)")
        jobs += make_jobs(args.out / name, CONFIG, base, arms, seeds, steps,
                          grid["fid_samples"], extra, grid.get("val_triples", VAL_TRIPLES))
        named = [a for a in (*ABLATIONS, *NAMED_ONLY) if a.name in args.ablations]
        side = grid["resolution"] // model["patch_size"]
        ablations = [check_blocks(with_layers(a, model["depth"]), side) for a in named]
        if name.split("-")[-1] in ("256", "smoke") and ablations:  # at the end of the budget
            ablation_seeds = seeds[:args.ablation_seeds or args.seeds]
            jobs += make_jobs(args.out / name, CONFIG, base, ablations, ablation_seeds, [grid["steps"]],
                              grid["fid_samples"], extra, grid.get("val_triples", VAL_TRIPLES))
    for job in jobs:
        job.checkpoint_every = args.checkpoint_every or 0
    return jobs


def write_report(args, records: list[dict], speed: dict, seconds: float) -> str:
    """The call's record (``OUT/record.npz``), the report rendered from it and ``study.json``."""
    meta = {"grids": args.grids, "report_only": args.report_only, "wall_seconds": seconds, "jobs": args.jobs,
            "throughput": speed, "threads": torch.get_num_threads(), "configs": getattr(args, "configs", [])}
    record = results.build("study", args.command, records, args.out, meta,
                           kept_samples(records, args.out, args.grids))
    results.save(record, args.out / "record.npz")
    render(results.load(args.out / "record.npz"), args.out)  # as regenerating from the file renders it
    everything = {"command": args.command, "records": records, "throughput": speed, **file_record("study")}
    atomic_write_text(args.out / "study.json", json.dumps(everything, indent=1))
    return (args.out / "study.md").read_text()


def check_names(flag: str, names: list[str], choices: list[Arm]) -> None:
    """Each of ``names`` must be one of ``choices``' names, once (``ConfigError`` naming ``flag``)."""
    known = [a.name for a in choices]
    if any(n not in known for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"{flag} {' '.join(names)}: each must be one of {known}, once")


def select_grids(args) -> list[str]:
    """The GRIDS keys of this call (--quick / --smoke also set seeds, jobs, ablations, throughput)."""
    if args.quick or args.smoke:
        mode = "quick" if args.quick else "smoke"
        args.seeds, args.no_throughput = min(args.seeds, 2), True
        args.jobs, args.no_ablations = (args.jobs, True) if args.quick else (1, args.no_ablations)
        return [grid_key(args.data, mode)]
    names = args.grids or (["64", "256"] if args.data == "digits" else ["256"])
    keys = [grid_key(args.data, n) for n in names]
    missing = [n for n, k in zip(names, keys) if k not in GRIDS]
    if missing:
        raise ConfigError(f"--grids {' '.join(missing)} is not a grid of --data {args.data} "
                          f"(digits: 64 256; shapes: 256 1024)")
    return keys


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, parsed (checked by :func:`main`)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=expand_path, default="runs/study")
    parser.add_argument("--data", choices=["digits", "shapes"], default="digits",
                        help="digits (8x8 upsampled; grids 64, 256) or shapes (drawn; grids 256, 1024)")
    parser.add_argument("--grids", nargs="+", choices=["64", "256", "1024"], default=None,
                        help="token counts (default: 64 256 for digits, 256 for shapes)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds --first-seed .. --first-seed + --seeds - 1 (fresh seeds: ones no earlier "
                             "reading used)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    parser.add_argument("--steps", type=int, default=None, help="training budget (default: per grid)")
    parser.add_argument("--eval-steps", type=int, nargs="+", default=None, metavar="STEP",
                        help="the main arms' evaluation steps (default: a quarter, a half and all of the "
                             "budget; the budget is always one)")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                        help="a training checkpoint every STEPS steps (default: the evaluation steps' gcd); "
                             "a long run stopped between them resumes from the last one")
    parser.add_argument("--fid-samples", type=int, default=None)
    parser.add_argument("--val-triples", type=int, default=None,
                        help="fixed held-out (image, timestep, noise) triples of the validation loss "
                             f"({VAL_TRIPLES}: 256 per timestep bucket)")
    parser.add_argument("--arms", nargs="*", default=[a.name for a in MAIN_ARMS], metavar="ARM",
                        help="main arms to run, in this order (default: softmax linear mhla; none: "
                             "ablations only)")
    parser.add_argument("--ablations", nargs="+", default=[a.name for a in ABLATIONS], metavar="ARM",
                        help="ablation arms at 256 tokens (default: all the paper's; mhla+softmax@L, "
                             "MHLA keeping layer L as softmax, and mhla-blocksBxB, MHLA with BxB blocks, "
                             "only when named)")
    parser.add_argument("--no-ablations", action="store_true")
    parser.add_argument("--ablation-seeds", type=int, default=None,
                        help="seeds of the ablation arms (default: --seeds; the first ones)")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--report-only", action="store_true",
                        help="tables and plots from the runs finished so far; train nothing")
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized (about 10 min of 2 cores): main arms, 2 seeds, a short budget")
    parser.add_argument("--smoke", action="store_true", help="seconds: a tiny model, 4 steps, 2 seeds")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    positive = ("seeds", "ablation_seeds", "jobs", "steps", "fid_samples", "val_triples", "checkpoint_every")
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < (2 if name == "fid_samples" else 1):
            least = "at least 2" if name == "fid_samples" else "positive"
            raise ConfigError(f"--{name.replace('_', '-')} must be {least}, got {getattr(args, name)}")
    if args.val_triples is not None and args.val_triples % BUCKETS:  # a bucket per quarter of the timesteps
        raise ConfigError(f"--val-triples must be a multiple of {BUCKETS} (the validation loss's timestep "
                          f"buckets), got {args.val_triples}")
    if args.first_seed < 0:
        raise ConfigError(f"--first-seed must be >= 0, got {args.first_seed}")
    if args.eval_steps and min(args.eval_steps) < 1:
        raise ConfigError(f"--eval-steps {' '.join(map(str, args.eval_steps))}: each must be positive")
    check_names("--arms", args.arms, MAIN_ARMS)
    check_names("--ablations", args.ablations, [*ABLATIONS, *NAMED_ONLY])
    args.grids = select_grids(args)
    if args.no_ablations:
        args.ablations = []
    if args.ablations and args.ablation_seeds is not None and args.ablation_seeds > args.seeds:
        raise ConfigError(f"--ablation-seeds {args.ablation_seeds} is more than this call's "
                          f"{args.seeds} seeds (--seeds; --quick and --smoke run at most 2)")
    if not args.arms and not args.ablations:
        raise ConfigError("--arms is empty and no ablation runs: nothing to run")
    for grid in args.grids:  # every comparison's primary metric, declared before anything runs
        data = GRIDS[grid].get("data", "digits")
        check_questions(questions([*args.arms, *args.ablations], data),
                        (PRIMARY.get(data), *SECONDARY[data]), "eval/study.py")
    args.out = Path(args.out)
    args.command = "python eval/study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # a line per file of every checkpoint
    start = time.perf_counter()
    jobs = plan(args)
    records = study_records(args.out, jobs, args.jobs, args.report_only, "study")
    for r in records:  # records of earlier versions name the digits' FID only
        r.setdefault("fid", r.get("fid_digits"))
    speed = {} if args.no_throughput else {n: throughput(n) for n in (64, 256, 1024, 4096)}
    args.configs = results.configs(jobs)
    print(write_report(args, records, speed, time.perf_counter() - start))
    return records


if __name__ == "__main__":
    run(main)
