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
import sys
from pathlib import Path

import torch
from diffusers import DDPMScheduler, DiTTransformer2DModel

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_timing beside this file

from step_timing import StepBench, parse_step_args, step_main, timed_report  # noqa: E402

from mhla_gen import MHLAConfig, clamp_mixing_, install_mhla  # noqa: E402
from mhla_gen.commands.cli import run as run_cli  # noqa: E402
from mhla_gen.train.objectives import DDPMLoss  # noqa: E402

# DiT paper Table 1 (as benchmarks/conversion_budget.py)
DIT_XL2_CONFIG = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                      num_layers=28, sample_size=32, patch_size=2, num_embeds_ada_norm=1000)
BENCH = StepBench(
    script="bench_dit_step.py", step="training step (random weights)", reference="softmax",
    batch=32, batch_help="images per step (default 32)", tiny_help="mhla_gen.testing.TINY_DIT_CONFIG (tests)",
    precision="--mixed-precision", precision_choices=("no", "bf16"), precision_default=("bf16", "no"),
    precision_help="autocast of the forward (train.mixed_precision); default bf16 on CUDA, else no",
    precision_label="mixed precision {}", min_warmup=1,
    warmup_why=" (AdamW creates its states in the first step)", ms_digits=1, images_column=True,
)


def parse_args(argv=None) -> argparse.Namespace:
    return parse_step_args(BENCH, __doc__, argv)


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
    title = "tiny DiT (TINY_DIT_CONFIG)" if args.tiny else "DiT-XL/2"
    return timed_report(BENCH, steps, args, title, config)


def main(argv=None) -> dict:
    return step_main(BENCH, parse_args(argv), argv, run)


if __name__ == "__main__":
    run_cli(main)
