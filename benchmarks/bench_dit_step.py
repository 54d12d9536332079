"""One DiT-XL/2 training step at a real batch: softmax attention against MHLA, in images per second.

    python benchmarks/bench_dit_step.py --device cuda                  # DiT-XL/2, 256 px, batch 32, bf16
    python benchmarks/bench_dit_step.py --device cuda --compile        # both models torch.compile'd
    python benchmarks/bench_dit_step.py --tiny --device cpu --batch 2 --reps 2   # plumbing (tests)

The model: ``DiTTransformer2DModel`` with DiT-XL/2's shape (DiT paper, Table 1: 28 layers, hidden 1152 =
16 heads x 72, patch 2; learned sigma, so 8 output channels; 1000 classes) and random weights, on
32 x 32 x 4 latents (256 px through the SD VAE): a 16 x 16 token grid. Two copies of one random model:
``softmax`` keeps diffusers' stock processor (SDPA; FlashAttention on CUDA under bf16 autocast), ``mhla``
gets ``install_mhla(MHLAConfig.preset("dit-256"))`` (4 x 4 blocks of 4 x 4 tokens). ``--tiny``:
``mhla_gen.testing.TINY_DIT_CONFIG`` on 8 x 8 latents (4 x 4 tokens, one per block).

The step is what ``scripts/train_dit.py`` runs with ``train.mixed_precision=bf16``: fp32 parameters, the
forward under ``torch.autocast(bf16)`` (Accelerate's autocast), DiT's hybrid loss in fp32
(``mhla_gen.train.objectives.DDPMLoss`` on diffusers' linear 1000-step DDPM schedule) on noised latents,
backward, AdamW (lr 1e-4, as DiT), ``clamp_mixing_`` for MHLA, ``zero_grad``; TF32 on for fp32 matmuls
(``train.allow_tf32``). Left out: data loading, the VAE, EMA, gradient-norm logging, other processes.

Timing (``step_timing.py``): ``--warmup`` untimed steps per model (AdamW's states; with ``--compile`` the
compilation, not counted), then ``--reps`` repetitions, each timing one step of every model in rotating
order. Reported: median ms per step, images/s (batch over the median), the median of per-repetition
speed-ups over softmax, and the peak memory of each model's warm-up (CUDA). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import shlex
import statistics
import sys
from pathlib import Path

import torch
from diffusers import DDPMScheduler, DiTTransformer2DModel

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_timing beside this file

from step_timing import device_label, interleaved_seconds, median_ratio  # noqa: E402

from mhla_gen import MHLAConfig, clamp_mixing_, install_mhla  # noqa: E402
from mhla_gen.commands.cli import run as run_cli  # noqa: E402
from mhla_gen.train.objectives import DDPMLoss  # noqa: E402

# DiT paper Table 1 (as benchmarks/conversion_budget.py)
DIT_XL2_CONFIG = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                      num_layers=28, sample_size=32, patch_size=2, num_embeds_ada_norm=1000)
VARIANTS = ("softmax", "mhla")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="images per step (default 32)")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (both models in each)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default=None,
                        help="autocast of the forward (train.mixed_precision); default bf16 on CUDA, else no")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models (inductor)")
    parser.add_argument("--tiny", action="store_true", help="mhla_gen.testing.TINY_DIT_CONFIG (tests)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    for name in ("batch", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 1:
        parser.error(f"--warmup must be at least 1 (AdamW creates its states in the first step), got "
                     f"{args.warmup}")
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available")
    args.mixed_precision = args.mixed_precision or ("bf16" if args.device.type == "cuda" else "no")
    return args


def build_models(config: dict, device: torch.device) -> dict[str, DiTTransformer2DModel]:
    """``{variant: model}`` in train mode: one random fp32 model (built on ``device``), MHLA in a copy."""
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of a minute for 675 M parameters
        base = DiTTransformer2DModel(**config).to(device).train()
    side = config["sample_size"] // config["patch_size"]
    blocks = tuple(min(b, side) for b in MHLAConfig.preset("dit-256").blocks)
    mhla = install_mhla(copy.deepcopy(base), MHLAConfig.preset("dit-256", blocks=blocks))
    return {"softmax": base, "mhla": mhla}


def make_batch(config: dict, batch: int, scheduler, device) -> dict:
    """Noised latents, their noise, timesteps and class labels (one fixed batch)."""
    g = torch.Generator().manual_seed(0)
    side, channels = config["sample_size"], config["in_channels"]
    x0 = torch.randn(batch, channels, side, side, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    t = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), generator=g)
    labels = torch.randint(0, config["num_embeds_ada_norm"], (batch,), generator=g)
    xt = scheduler.add_noise(x0, noise, t)
    return {name: x.to(device) for name, x in dict(x0=x0, xt=xt, noise=noise, t=t, labels=labels).items()}


def training_step(model, runner, optimizer, objective, batch: dict, args) -> None:
    """Forward (autocast), DiT's loss, backward, AdamW, the mixing clamp, zero_grad."""
    autocast = (torch.autocast(args.device.type, dtype=torch.bfloat16) if args.mixed_precision == "bf16"
                else contextlib.nullcontext())
    with autocast:
        out = runner(batch["xt"], timestep=batch["t"], class_labels=batch["labels"], return_dict=False)[0]
    loss = objective(out, batch["x0"], batch["xt"], batch["noise"], batch["t"])
    loss.backward()
    optimizer.step()
    clamp_mixing_(model)  # a no-op without MHLA
    optimizer.zero_grad(set_to_none=True)


def run(args) -> dict:
    if args.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if args.tiny:
        from mhla_gen.testing import TINY_DIT_CONFIG

        config = dict(TINY_DIT_CONFIG)
    else:
        config = dict(DIT_XL2_CONFIG)
    models = build_models(config, args.device)
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    objective = DDPMLoss(scheduler, learn_sigma=config["out_channels"] == 2 * config["in_channels"])
    batch = make_batch(config, args.batch, scheduler, args.device)
    steps = {}
    for name, model in models.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        runner = torch.compile(model) if args.compile else model
        steps[name] = lambda m=model, r=runner, o=optimizer: training_step(m, r, o, objective, batch, args)
    seconds, peak = interleaved_seconds(steps, args.reps, args.warmup, args.device)
    rows = {}
    for name in VARIANTS:
        median_s = statistics.median(seconds[name])
        rows[name] = dict(median_ms=1e3 * median_s, images_s=args.batch / median_s, peak_gib=peak[name],
                          speedup=median_ratio(seconds["softmax"], seconds[name]))
    side = config["sample_size"] // config["patch_size"]
    return dict(model="tiny DiT (TINY_DIT_CONFIG)" if args.tiny else "DiT-XL/2", config=config, rows=rows,
                tokens=side * side, device=device_label(args.device))


def markdown(report: dict, args, command: str) -> str:
    c = report["config"]
    lines = [
        f"{report['model']} training step (random weights): {c['num_layers']} layers, "
        f"{c['num_attention_heads']} heads x {c['attention_head_dim']}, {report['tokens']} tokens, batch "
        f"{args.batch}, mixed precision {args.mixed_precision}, compile {'on' if args.compile else 'off'}, "
        f"device {report['device']}, torch {torch.__version__}; {args.reps} reps after {args.warmup} "
        "warm-up.",
        f"Command: `{command}`", "",
        "| variant | median ms/step | images/s | speed-up vs softmax | peak GiB (warm-up) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in report["rows"].items():
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        lines.append(f"| {name} | {r['median_ms']:.1f} | {r['images_s']:.1f} | {r['speedup']:.2f}x "
                     f"| {peak} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "benchmarks/bench_dit_step.py", *given])
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = run(args)
    finally:
        torch.set_num_threads(threads)
    print(markdown(report, args, command))
    return report


if __name__ == "__main__":
    run_cli(main)
