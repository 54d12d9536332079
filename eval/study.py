"""Softmax vs linear vs MHLA attention on the embedded digits, with seeds, two grid sizes, learning
curves and the paper's MHLA ablations; tables and plots for the README.

    python eval/study.py                              # both grids, 3 seeds, ablations (see --help)
    python eval/study.py --grids 256 --seeds 5 --jobs 2
    python eval/study.py --quick                      # seconds: a smoke test of the whole pipeline

Every arm is one DiT of the same size trained with the same data, budget and seeds by
``mhla_gen.train.loop.train`` (configs/dit_digits.yaml + the overrides below); only the attention (or
one MHLA setting, for the ablations) differs. "linear" is MHLA with one block: global ReLU linear
attention, as SANA's. Grids:

* ``64``: 16x16 px digits, patch 2 -> an 8x8 token grid, MHLA blocks 2x2 (4 blocks of 16 tokens);
* ``256``: 32x32 px digits, patch 2 -> a 16x16 token grid, MHLA blocks 4x4 (16 blocks of 16 tokens,
  the paper's DiT-S/2 setting).

Each (arm, seed) is evaluated at 1/4, 1/2 and all of the budget (digits-FID of samples drawn with the
seed, label accuracy, training loss, attention rank / entropy), through ``mhla_gen.experiments`` (the
runner shared with eval/adaptation.py: resumable, parallel). Ablations (256 tokens, against plain MHLA
with the same seeds): uniform vs locality mixing init, fixed vs learnable mixing (paper Tab. 7a), CPE
and the output gate (App. F.2). Throughput of the three attentions is timed separately, side by side in
one process, at 64, 256 and 1024 tokens.

Writes OUT/study.md (tables), OUT/study.json (every record), OUT/curves_<grid>.png and
OUT/samples_<grid>.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from mhla_gen.cli import expand_path, run
from mhla_gen.errors import ConfigError
from mhla_gen.experiments import Arm, make_jobs, paired, study_records, summarize
from mhla_gen.folders import file_record
from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit import DiTTask
from mhla_gen.train.io import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "dit_digits.yaml")

MODEL = dict(hidden_size=64, depth=4, heads=4, patch_size=2)
GRIDS = {  # token count -> data and budget (sized for about an hour of 2 CPU cores per grid, see README)
    "64": dict(resolution=16, blocks=(2, 2), steps=1500, batch=32, fid_samples=1000, sample_steps=20),
    "256": dict(resolution=32, blocks=(4, 4), steps=1200, batch=32, fid_samples=500, sample_steps=10),
    "quick": dict(resolution=8, blocks=(2, 2), steps=4, batch=8, fid_samples=20, sample_steps=2),
}
QUICK_MODEL = dict(hidden_size=16, depth=1, heads=2, patch_size=2)
MAIN_ARMS = [Arm("softmax", ("model.attention=softmax",)), Arm("linear", ("model.attention=linear",)),
             Arm("mhla", ("model.attention=mhla",))]
ABLATIONS = [  # each against plain MHLA, same seeds
    Arm("mhla-uniform-init", ("model.attention=mhla", "mhla.mixing_init=uniform"), "ablation"),
    Arm("mhla-fixed-mixing", ("model.attention=mhla", "mhla.mixing_learnable=false"), "ablation"),
    Arm("mhla+cpe", ("model.attention=mhla", "mhla.cpe_kernel=3"), "ablation"),
    Arm("mhla+gate", ("model.attention=mhla", "mhla.gate=true"), "ablation"),
]


def base_overrides(grid: dict, model: dict) -> list[str]:
    steps = grid["steps"]
    return [
        f"data.resolution={grid['resolution']}", f"mhla.blocks=[{grid['blocks'][0]},{grid['blocks'][1]}]",
        *(f"model.{k}={v}" for k, v in model.items()),
        f"train.global_batch_size={grid['batch']}", f"train.lr_warmup_steps={min(50, steps // 10)}",
        f"log.every={max(1, steps // 30)}", "log.trackers=[]", "log.num_samples=1",
        f"log.sample_steps={grid['sample_steps']}",
    ]


def eval_steps(steps: int) -> list[int]:
    return sorted({max(1, steps // 4), max(1, steps // 2), steps})


def plan(args) -> list:
    """Every job of the study (both grids, all arms and seeds)."""
    jobs = []
    for name in args.grids:
        chosen = {"steps": args.steps, "fid_samples": args.fid_samples}
        grid = dict(GRIDS[name], **{k: v for k, v in chosen.items() if v})
        model = QUICK_MODEL if name == "quick" else MODEL
        base, seeds = base_overrides(grid, model), list(range(args.seeds))
        extra = {"grid": name, "tokens": (grid["resolution"] // model["patch_size"]) ** 2}
        jobs += make_jobs(args.out / name, CONFIG, base, MAIN_ARMS, seeds, eval_steps(grid["steps"]),
                          grid["fid_samples"], extra)
        if name in ("256", "quick") and not args.no_ablations:  # compared at the end of the budget only
            ablation_seeds = seeds[:args.ablation_seeds or args.seeds]
            jobs += make_jobs(args.out / name, CONFIG, base, ABLATIONS, ablation_seeds, [grid["steps"]],
                              grid["fid_samples"], extra)
    return jobs


# ------------------------------------------------------------------------------------------ throughput
def throughput(tokens: int, repeats: int = 5) -> dict[str, dict]:
    """Training (forward + backward + AdamW) and inference images/s of the study's model for each
    attention at ``tokens`` tokens (batch 8192 / tokens, at least 2), timed interleaved in this process
    (medians over ``repeats``)."""
    batch = max(2, 8192 // tokens)
    resolution = 2 * int(round(tokens**0.5))
    grid = dict(GRIDS["64" if tokens <= 64 else "256"], resolution=resolution)  # 2x2 or 4x4 blocks
    models, times = {}, {arm.name: {"train": [], "infer": []} for arm in MAIN_ARMS}
    for arm in MAIN_ARMS:
        cfg = load_config(DiTRunConfig, CONFIG, [*base_overrides(grid, MODEL), *arm.overrides])
        model = DiTTask(cfg).build_transformer()
        models[arm.name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(batch, 1, resolution, resolution)
    t, y = torch.randint(0, 1000, (batch,)), torch.randint(0, 10, (batch,))
    for _ in range(repeats + 1):  # the first round warms up
        for name, (model, opt) in models.items():
            start = time.perf_counter()
            model(x, timestep=t, class_labels=y).sample.square().mean().backward()
            opt.step()
            opt.zero_grad()
            middle = time.perf_counter()
            with torch.no_grad():
                model(x, timestep=t, class_labels=y)
            times[name]["train"].append(middle - start)
            times[name]["infer"].append(time.perf_counter() - middle)
    return {name: {k: batch / float(np.median(v[1:])) for k, v in d.items()} for name, d in times.items()}


# ------------------------------------------------------------------------------------------ report
def fmt(s: dict, digits: int = 2) -> str:
    """``mean ± ci (min–max)``."""
    ci = "" if np.isnan(s["ci"]) else f" ± {s['ci']:.{digits}f}"
    return f"{s['mean']:.{digits}f}{ci} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


METRICS = ("fid_digits", "label_accuracy", "loss", "attention_rank", "attention_entropy")


def grid_tables(records: list[dict], grid: str) -> str:
    """The final-step table, the FID curves and the paired comparisons of one grid, as markdown."""
    recs = [r for r in records if r["grid"] == grid]
    last = max(r["step"] for r in recs)
    arms = list(dict.fromkeys(r["arm"] for r in recs))
    stats = {m: summarize(recs, m) for m in METRICS}
    r0 = recs[0]
    seeds = stats["fid_digits"][(arms[0], last)]["n"]
    head = (f"**{r0['tokens']} tokens**: mean ± 95 % t-interval over {seeds} seeds (min–max; fewer where the "
            f"seeds column says so), at step "
            f"{last}; attention rank of {r0['attention_tokens']}, row entropy of at most "
            f"{r0['max_entropy']:.2f} nats")
    return "\n".join([head, "", final_table(stats, arms, last), curve_table(recs, stats),
                      paired_table(recs, arms, last)])


def final_table(stats: dict, arms: list[str], last: int) -> str:
    lines = ["| arm | seeds | FID ↓ | label acc ↑ | loss | attn rank | row entropy |",
             "|---|---|---|---|---|---|---|"]
    for arm in arms:
        cells = [fmt(stats[m][(arm, last)], d) for m, d in zip(METRICS, (2, 3, 4, 1, 3))]
        lines.append(f"| {arm} | {stats['fid_digits'][(arm, last)]['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def curve_table(recs: list[dict], stats: dict) -> str:
    """FID at every evaluation step, for the arms evaluated along training (the main arms)."""
    steps = sorted({r["step"] for r in recs})
    arms = [a for a in dict.fromkeys(r["arm"] for r in recs)
            if all((a, s) in stats["fid_digits"] for s in steps)]
    lines = ["FID along training:", "", "| arm | " + " | ".join(f"step {s}" for s in steps) + " |",
             "|---|" + "---|" * len(steps)]
    for arm in arms:
        lines.append(f"| {arm} | " + " | ".join(fmt(stats["fid_digits"][(arm, s)]) for s in steps) + " |")
    return "\n".join(lines) + "\n"


def paired_table(recs: list[dict], arms: list[str], last: int) -> str:
    """Per-seed differences (same data order, noise and sample seeds in both arms) at the last step."""
    ablations = [(a, "mhla") for a in arms if a.startswith("mhla") and a != "mhla"]
    lines = [f"Paired by seed, at step {last} (first minus second):", "",
             "| comparison | FID difference | seeds with lower FID | label acc difference |",
             "|---|---|---|---|"]
    for a, b in [("mhla", "softmax"), ("mhla", "linear"), *ablations]:
        if a in arms and b in arms:
            fid, acc = (paired(recs, a, b, m, last) for m in ("fid_digits", "label_accuracy"))
            lines.append(f"| {a} − {b} | {fmt(fid)} | {fid['negative']} of {fid['n']} | {fmt(acc, 3)} |")
    return "\n".join(lines) + "\n"


def throughput_table(rows: dict[int, dict]) -> str:
    names = [a.name for a in MAIN_ARMS]
    lines = ["| tokens | " + " | ".join(f"{n} train img/s | {n} infer img/s" for n in names) + " |",
             "|---|" + "---|---|" * len(names)]
    for tokens, row in rows.items():
        cells = [f"{row[n]['train']:.1f} | {row[n]['infer']:.1f}" for n in names]
        lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(records: list[dict], grid: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if r["grid"] == grid and r["group"] == "main"]
    stats = summarize(recs, "fid_digits")
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for arm in dict.fromkeys(r["arm"] for r in recs):
        steps = sorted(s for a, s in stats if a == arm)
        mean = [stats[(arm, s)]["mean"] for s in steps]
        ax.plot(steps, mean, marker="o", label=arm)
        low, high = ([stats[(arm, s)][k] for s in steps] for k in ("min", "max"))
        ax.fill_between(steps, low, high, alpha=0.15)
    ax.set(xlabel="training step", ylabel="digits-FID (lower is better)", yscale="log",
           title=f"{recs[0]['tokens']} tokens: mean over seeds, band = min–max")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_samples(records: list[dict], grid: str, out: Path, path: Path) -> None:
    """Ten samples of each class per main arm (seed 0, the last step), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if r["grid"] == grid and r["seed"] == 0 and r["group"] == "main"]
    last = max(r["step"] for r in recs)
    recs = [r for r in recs if r["step"] == last]
    fig, axes = plt.subplots(1, len(recs), figsize=(3.2 * len(recs), 3.5))
    for ax, r in zip(np.atleast_1d(axes), recs):
        samples = np.load(out / grid / "results" / r["arm"] / "seed0" / f"step{last:07d}_samples.npy")
        rows = [np.concatenate(list(samples[i::10][:10]), axis=0) for i in range(min(10, len(samples)))]
        ax.imshow(np.concatenate(rows, axis=1), cmap="gray", vmin=0, vmax=255)
        ax.set_title(f"{r['arm']}: FID {r['fid_digits']:.1f}", fontsize=9)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(args, records: list[dict], speed: dict, seconds: float) -> str:
    how = ("tables from the runs finished so far" if args.report_only
           else f"wall time of this call {seconds / 60:.0f} min, {args.jobs} worker processes")
    text = [f"# Softmax / linear / MHLA study\n\n`{args.command}` — {time.strftime('%Y-%m-%d')}, {how}, "
            f"torch {torch.__version__}; training and evaluation summed over all runs: "
            f"{sum(r.get('segment_seconds', 0) for r in records) / 3600:.1f} core-hours\n"]
    for grid in args.grids:
        text.append(grid_tables(records, grid))
        plot_curves(records, grid, args.out / f"curves_{grid}.png")
        plot_samples(records, grid, args.out, args.out / f"samples_{grid}.png")
    if speed:
        text.append("Throughput of the study's model (images/s; batch 8192 / tokens; the three attentions "
                    f"timed interleaved in one process, {torch.get_num_threads()} threads):\n\n"
                    + throughput_table(speed))
    report = "\n".join(text)
    atomic_write_text(args.out / "study.md", report)
    everything = {"command": args.command, "records": records, "throughput": speed, **file_record("study")}
    atomic_write_text(args.out / "study.json", json.dumps(everything, indent=1))
    return report


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=expand_path, default="runs/study")
    parser.add_argument("--grids", nargs="+", choices=["64", "256"], default=["64", "256"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    parser.add_argument("--steps", type=int, default=None, help="training budget (default: per grid)")
    parser.add_argument("--fid-samples", type=int, default=None)
    parser.add_argument("--no-ablations", action="store_true")
    parser.add_argument("--ablation-seeds", type=int, default=None,
                        help="seeds of the ablation arms (default: --seeds; the first ones)")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--report-only", action="store_true",
                        help="tables and plots from the runs finished so far; train nothing")
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 steps, 2 seeds (a smoke test)")
    args = parser.parse_args(argv)
    for name in ("seeds", "ablation_seeds", "jobs", "steps", "fid_samples"):
        if getattr(args, name) is not None and getattr(args, name) < (2 if name == "fid_samples" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.quick:
        args.grids, args.seeds, args.jobs, args.no_throughput = ["quick"], min(args.seeds, 2), 1, True
    args.out = Path(args.out)
    args.command = "python eval/study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # a line per file of every checkpoint
    start = time.perf_counter()
    records = study_records(args.out, plan(args), args.jobs, args.report_only)
    speed = {} if args.no_throughput else {n: throughput(n) for n in (64, 256, 1024, 4096)}
    print(write_report(args, records, speed, time.perf_counter() - start))
    return records


if __name__ == "__main__":
    run(main)
