"""Softmax vs linear vs MHLA attention: three DiTs of identical size, budget and seed on the embedded
digits (pixel space), then one table (FID with the digits CNN, label accuracy, final loss, attention
rank/entropy, training and sampling throughput) and one PNG of sample grids side by side.

    python eval/study.py                       # the CPU study (~25 min on an idle 2-core machine)
    python eval/study.py --quick               # seconds: a smoke test of the whole pipeline
    python eval/study.py --steps 2000 --fid-samples 2000 --out runs/study_long

Training is scripts/train_dit.py's library entry point (``mhla_gen.train.loop.train`` with
``DiTTask``) on configs/dit_digits.yaml plus the overrides below; only ``model.attention`` differs
between the three runs ("linear" = MHLA with one block = global ReLU linear attention, so the three
share every other setting). Writes OUT/study.md, OUT/study.json, OUT/study_samples.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from mhla_gen.cli import run
from mhla_gen.data.digits import digits_tensors
from mhla_gen.folders import claim
from mhla_gen.metrics import digits_extractor, extract_features, fid_from_features
from mhla_gen.metrics.attention import attention_statistics, example_inputs
from mhla_gen.serialization import load_transformer
from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit import DiTTask
from mhla_gen.train.io import read_jsonl
from mhla_gen.train.loop import train

ROOT = Path(__file__).resolve().parents[1]

ATTENTIONS = ("softmax", "linear", "mhla")

# model / budget of the full study: sized so that three runs + FID fit ~25 min of 2 CPU cores
FULL = dict(resolution=16, patch_size=2, hidden_size=64, depth=4, heads=4, steps=1500, batch=32,
            fid_samples=1000, sample_steps=20)
QUICK = dict(resolution=8, patch_size=2, hidden_size=16, depth=1, heads=2, steps=3, batch=8, fid_samples=20,
             sample_steps=2)


def run_overrides(attention: str, out: Path, seed: int, s: dict) -> list[str]:
    return [
        f"output_dir={out / attention}", f"seed={seed}", f"model.attention={attention}",
        f"data.resolution={s['resolution']}", f"model.hidden_size={s['hidden_size']}",
        f"model.depth={s['depth']}", f"model.heads={s['heads']}", f"model.patch_size={s['patch_size']}",
        "mhla.blocks=[2,2]",
        f"train.max_steps={s['steps']}", f"train.global_batch_size={s['batch']}",
        f"train.checkpoint_every={s['steps']}", f"train.lr_warmup_steps={min(50, s['steps'] // 10)}",
        f"log.every={max(1, s['steps'] // 20)}", "log.trackers=[]", "log.num_samples=1",
        f"log.sample_steps={s['sample_steps']}", "eval.fid_num_samples=0",
    ]


def mean_attention_stats(transformer, resolution: int, seed: int) -> dict:
    """Rank and entropy averaged over layers, on 4 real digits noised to t = 500."""
    images, labels = digits_tensors(resolution)
    pick = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))[:4]
    kwargs = example_inputs(transformer, 4, resolution, timestep=500, images=images[pick] * 2 - 1,
                            labels=labels[pick], seed=seed)
    stats = attention_statistics(transformer, lambda: transformer(**kwargs))
    return {"rank": float(np.mean([s["rank"] for s in stats])), "tokens": stats[0]["tokens"],
            "entropy": float(np.mean([s["entropy"] for s in stats])), "max_entropy": stats[0]["max_entropy"],
            "per_layer": stats}


def evaluate_run(attention: str, cfg: DiTRunConfig, final: Path, s: dict, train_seconds: float) -> dict:
    records = [r for r in read_jsonl(Path(cfg.output_dir) / "metrics.jsonl") if "loss" in r]
    transformer = load_transformer(final)
    task = DiTTask(cfg)
    num_classes = cfg.model.num_classes
    labels = [i % num_classes for i in range(s["fid_samples"])]
    start = time.perf_counter()
    fake = task.generate(transformer, labels, seed=cfg.seed + 1, output_type="pt").cpu()  # (N, 1, R, R)
    sample_seconds = time.perf_counter() - start

    extractor = digits_extractor()
    real, _ = digits_tensors(s["resolution"])
    fake_f, real_f = extract_features(extractor, fake), extract_features(extractor, real)
    accuracy = (torch.from_numpy(fake_f["logits"]).argmax(-1) == torch.tensor(labels)).double().mean().item()
    steps_per_s = [r["steps_per_s"] for r in records[1:]] or [r["steps_per_s"] for r in records]
    return {
        "attention": attention,
        "fid_digits": fid_from_features(real_f["pool"], fake_f["pool"]),
        "label_accuracy": accuracy,
        "final_loss": records[-1]["loss"],
        "attention_stats": mean_attention_stats(transformer, s["resolution"], cfg.seed),
        "train_images_per_s": float(np.mean(steps_per_s)) * cfg.train.global_batch_size,
        "train_seconds": train_seconds,
        "sample_images_per_s": len(labels) / sample_seconds,
        "parameters": sum(p.numel() for p in transformer.parameters()),
        "samples": fake[: 10 * min(num_classes, 10)] if len(fake) >= 100 else fake,
    }


def markdown_table(results: list[dict], s: dict, extractor_accuracy: float) -> str:
    tokens = results[0]["attention_stats"]["tokens"]
    lines = [
        f"DiT hidden {s['hidden_size']}, depth {s['depth']}, heads {s['heads']}, "
        f"{s['resolution']}×{s['resolution']} px digits ({tokens} tokens, MHLA blocks 2×2), "
        f"{s['steps']} steps × batch {s['batch']}, FID on {s['fid_samples']} samples ({s['sample_steps']} "
        f"DPM steps) vs the 1797 real digits, features of the digits CNN (test accuracy "
        f"{extractor_accuracy:.3f}).",
        "",
        "| attention | FID (digits CNN) ↓ | label acc ↑ | final loss | attn rank (of N) | row entropy "
        f"(nats, log N = {results[0]['attention_stats']['max_entropy']:.2f}) | train img/s | sample img/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a = r["attention_stats"]
        lines.append(f"| {r['attention']} | {r['fid_digits']:.2f} | {r['label_accuracy']:.3f} "
                     f"| {r['final_loss']:.4f} | {a['rank']:.1f} / {a['tokens']} | {a['entropy']:.3f} "
                     f"| {r['train_images_per_s']:.1f} | {r['sample_images_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def save_sample_grids(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torchvision.utils import make_grid

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 4.4))
    for ax, r in zip(np.atleast_1d(axes), results):
        samples = r["samples"]
        columns = 10 if len(samples) >= 100 else max(1, int(len(samples) ** 0.5))
        # samples are ordered 0,1,...,9,0,1,...: put one class per column
        grid = make_grid(samples, nrow=columns, padding=1, pad_value=0.5)[0]
        ax.imshow(grid.numpy(), cmap="gray", vmin=0, vmax=1)
        ax.set_title(f"{r['attention']}  FID {r['fid_digits']:.1f}")
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/study")
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps, 20 samples (a smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--fid-samples", type=int, default=None)
    parser.add_argument("--attentions", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS)
    parser.add_argument("--config", default=str(ROOT / "configs" / "dit_digits.yaml"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; these models are tiny, and on a shared CPU extra "
                             "threads mostly spin (measured: 1 thread ran a DiT step 7-10x faster than 2 "
                             "on a busy 2-core box)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run_study(args)
    finally:
        torch.set_num_threads(threads)


def run_study(args) -> list[dict]:

    s = dict(QUICK if args.quick else FULL)
    s["steps"] = args.steps or s["steps"]
    s["fid_samples"] = args.fid_samples or s["fid_samples"]
    out = claim(args.out, "study", "--out")  # new, empty or a study folder of ours (mhla_gen.folders)
    torch.manual_seed(args.seed)

    results = []
    for attention in args.attentions:
        cfg = load_config(DiTRunConfig, args.config, run_overrides(attention, out, args.seed, s))
        start = time.perf_counter()
        final = train(cfg, DiTTask(cfg))
        results.append(evaluate_run(attention, cfg, final, s, time.perf_counter() - start))
        print(f"[study] {attention}: FID {results[-1]['fid_digits']:.2f}", flush=True)

    extractor_accuracy = digits_extractor().test_accuracy
    table = markdown_table(results, s, extractor_accuracy)
    (out / "study.md").write_text(table)
    save_sample_grids(results, out / "study_samples.png")
    serializable = [{k: v for k, v in r.items() if k != "samples"} for r in results]
    (out / "study.json").write_text(json.dumps({"settings": s, "seed": args.seed, "results": serializable},
                                               indent=2) + "\n")
    print(table)
    return serializable


if __name__ == "__main__":
    run(main)
