"""Whole-model throughput of a DiT with softmax, global linear and MHLA self-attention.

    python benchmarks/bench_models.py                      # DiT-S/2 shapes, depth 12, 256/1024/4096 tokens
    python benchmarks/bench_models.py --depth 4 --reps 5 --threads 2
    python benchmarks/bench_models.py --device cuda --dtype bf16 --batch 32
    python benchmarks/bench_models.py --depth 4 --tokens 256 --batch 1 --attention-breakdown
    python benchmarks/bench_models.py --depth 4 --tokens 256 1024 --compile   # eager vs torch.compile

The model is ``DiTTransformer2DModel`` with DiT-S/2 shapes (hidden 384 = 6 heads x 64, patch 2, 4 latent
channels; ``--heads`` / ``--head-dim`` change the split, e.g. SANA's head dim 32 as 12 x 32); ``--depth``
reduces the 12 blocks for quick CPU runs. Token counts 256 / 1024 / 4096 are
latents of 32 / 64 / 128 pixels. Three identical copies differ only in the ``attn1`` processor:

- ``softmax``: diffusers' stock ``AttnProcessor2_0`` (SDPA);
- ``linear``: diffusers' own ``SanaLinearAttnProcessor2_0`` (SANA's global ReLU linear attention) set on
  DiT's ``attn1`` (same signature; DiT's residual/rescale options are off, so nothing is lost);
- ``mhla``: ``install_mhla(blocks=(4, 4))``.

Training step = forward + MSE loss + backward + AdamW step (+ the mixing clamp for MHLA); inference =
forward under inference_mode.

Timing: ``--reps`` repetitions; in each, the three models run back to back (interleaved), so a machine
that slows down hurts all of them alike. One sample times enough consecutive steps to last at least
``--min-sample-s`` (step counts are fixed per model and size from the warm-up), so small sizes are not
one short, jittery call. Each sample directly follows an untimed step of the same model, so no model
pays for re-growing the allocator's heap after another one's large free (softmax's N×N scores).
Throughput is ``batch`` over the median time per step; ratios are medians of the per-repetition ratios
(as ``bench_attention.py``), which cancels drift that the interleaving leaves.
Prints Markdown tables (items/s).

``--compile`` adds a ``torch.compile`` (inductor, static shapes) twin of each model, sharing its
weights and optimizer, timed in the same interleaved repetitions, and a table of eager against compiled
steps (compile time is not counted: the warm-up step compiles).

Allocator: glibc as it comes. On a small CPU box, freed blocks above a self-adjusting size go back to the
kernel and are faulted in again by the next step; that costs every model alike (mostly the parameter
gradients ``zero_grad`` frees) and moves single runs by a few percent, which the interleaved, paired
ratios absorb. GPU runs use the CUDA caching allocator.

``--attention-breakdown`` adds a table that splits the inference step into the time spent inside the
self-attention modules (``attn1`` of every block: q/k/v/out projections and the attention kernel, timed by
forward pre/post hooks) and the rest of the step, in ms per step. The rest is the same computation in all
three models, so it shows how much of a ratio is the attention itself and how much is run-to-run noise.
The hooks cost a few µs per layer, so throughput from such a run is slightly lower than without them.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time

import torch
from diffusers import DiTTransformer2DModel
from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0

from mhla_gen import MHLAConfig, clamp_mixing_, install_mhla
from mhla_gen.commands.cli import run as run_cli

MODES = ("softmax", "linear", "mhla")
LABELS = {"softmax": "softmax", "linear": "linear", "mhla": "MHLA"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depth", type=int, default=12, help="transformer blocks (DiT-S has 12)")
    parser.add_argument("--heads", type=int, default=6, help="attention heads (DiT-S has 6)")
    parser.add_argument("--head-dim", type=int, default=64, help="dimension per head (DiT-S has 64)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--min-sample-s", type=float, default=0.3,
                        help="each timed sample repeats the step until it lasts at least this long")
    parser.add_argument("--blocks", type=int, nargs=2, default=[4, 4])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--compile", action="store_true",
                        help="also time torch.compile'd twins of the three models (eager vs compiled table)")
    parser.add_argument("--attention-breakdown", action="store_true",
                        help="also time the self-attention modules inside the inference step (ms per step)")
    args = parser.parse_args(argv)
    for n in args.tokens:
        side = round(n**0.5)
        if side * side != n:
            parser.error(f"--tokens must be square numbers (a side x side token grid), got {n}")
    if min(args.depth, args.heads, args.head_dim, args.batch, args.reps) < 1 or args.min_sample_s < 0:
        parser.error("--depth, --heads, --head-dim, --batch and --reps must be positive, "
                     "--min-sample-s not negative")
    if min(args.blocks) < 1:
        parser.error(f"--blocks must be positive, got {args.blocks}")
    return args


def build_models(
    depth: int, blocks, device, dtype, heads: int = 6, head_dim: int = 64
) -> dict[str, DiTTransformer2DModel]:
    torch.manual_seed(0)
    base = DiTTransformer2DModel(
        num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4, out_channels=8,
        num_layers=depth, sample_size=32, patch_size=2, num_embeds_ada_norm=1000,
    )
    linear = copy.deepcopy(base)
    for block in linear.transformer_blocks:
        block.attn1.set_processor(SanaLinearAttnProcessor2_0())
    mhla = install_mhla(copy.deepcopy(base), MHLAConfig(blocks=tuple(blocks)))
    models = {"softmax": base, "linear": linear, "mhla": mhla}
    for model in models.values():
        model.to(device)
        if dtype != torch.float32:
            model.to(dtype)
    return models


def make_batch(tokens: int, batch: int, device, dtype):
    side = 2 * round(tokens**0.5)  # latent pixels = token side x patch 2
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(batch, 4, side, side, generator=g).to(device, dtype)
    target = torch.randn(batch, 8, side, side, generator=g).to(device, dtype)
    t = torch.randint(0, 1000, (batch,), generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    return x, target, t, y


def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device, steps: int = 1) -> float:
    """Seconds per call of ``fn`` over ``steps`` consecutive calls."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / steps


class AttentionTimer:
    """Wall time spent inside the ``attn1`` forward of every block of one model (forward hooks)."""

    def __init__(self, model, device):
        self.device, self.total_s, self._start = device, 0.0, 0.0
        self._handles = []
        for block in model.transformer_blocks:
            self._handles.append(block.attn1.register_forward_pre_hook(self._enter))
            self._handles.append(block.attn1.register_forward_hook(self._leave))

    def _enter(self, module, args):
        sync(self.device)
        self._start = time.perf_counter()

    def _leave(self, module, args, output):
        sync(self.device)
        self.total_s += time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


COMPILED = " compiled"  # suffix of a torch.compile twin's name in ``models``
RATIOS = (("mhla", "linear"), ("mhla", "softmax"))
COMPILE_RATIOS = (("mhla compiled", "mhla"), ("mhla compiled", "linear compiled"))


def bench_size(models, optimizers, tokens, args, dtype):
    """``{kind: {"items_s": {model: items/s}, "ratio": {(a, b): median of per-rep time_b / time_a}}}``
    (a ratio above 1: ``a`` is faster); with ``--attention-breakdown`` also
    ``result["infer"]["attention_ms"]`` / ``["rest_ms"]`` ``{model: median ms per step}``."""
    x, target, t, y = make_batch(tokens, args.batch, args.device, dtype)

    def train_step(name):
        base = name.removesuffix(COMPILED)  # a compiled twin shares the eager model's weights and optimizer
        opt = optimizers[base]
        out = models[name](x, timestep=t, class_labels=y).sample
        loss = torch.nn.functional.mse_loss(out.float(), target.float())
        loss.backward()
        opt.step()
        if base == "mhla":
            clamp_mixing_(models[base])  # the paper's [0, 1] projection, part of every MHLA training step
        opt.zero_grad(set_to_none=True)

    def infer(name):
        with torch.inference_mode():
            models[name](x, timestep=t, class_labels=y)

    result = {}
    for kind, step in (("train", train_step), ("infer", infer)):
        for model in models.values():
            model.train(kind == "train")
        breakdown = kind == "infer" and args.attention_breakdown
        timers = {name: AttentionTimer(models[name], args.device) for name in MODES} if breakdown else {}
        steps = {}
        for name in models:  # warm-up (compiles the twins); its duration sizes the samples
            step(name)
            warm_s = timed(lambda n=name, f=step: f(n), args.device)
            steps[name] = max(1, math.ceil(args.min_sample_s / warm_s))
        times = {name: [] for name in models}
        attention_s = {name: [] for name in timers}
        for _ in range(args.reps):
            for name in models:
                step(name)  # untimed: warms this model's allocations (see the module docstring)
                if name in timers:
                    timers[name].total_s = 0.0
                times[name].append(timed(lambda n=name, f=step: f(n), args.device, steps[name]))
                if name in timers:
                    attention_s[name].append(timers[name].total_s / steps[name])
        for timer in timers.values():
            timer.remove()
        pairs = RATIOS + (COMPILE_RATIOS if args.compile else ())
        result[kind] = {
            "items_s": {name: args.batch / statistics.median(ts) for name, ts in times.items()},
            "ratio": {
                (a, b): statistics.median(tb / ta for ta, tb in zip(times[a], times[b])) for a, b in pairs
            },
        }
        if breakdown:
            result[kind]["attention_ms"] = {n: 1e3 * statistics.median(s) for n, s in attention_s.items()}
            result[kind]["rest_ms"] = {
                name: 1e3 * statistics.median(t - a for t, a in zip(times[name], attention_s[name]))
                for name in timers
            }
    return result


def markdown(results, kind: str) -> str:
    lines = [
        f"| tokens | softmax {kind} (items/s) | linear {kind} | MHLA {kind} | MHLA / linear "
        "| MHLA / softmax |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for tokens, r in results.items():
        s, lin, m = (r[kind]["items_s"][name] for name in MODES)
        vs_linear, vs_softmax = (r[kind]["ratio"][pair] for pair in RATIOS)
        lines.append(f"| {tokens} | {s:.2f} | {lin:.2f} | {m:.2f} | {vs_linear:.2f}x | {vs_softmax:.2f}x |")
    return "\n".join(lines)


def compile_markdown(results) -> str:
    """Eager and compiled items/s per model, and MHLA compiled against MHLA eager and linear compiled."""
    models = " | ".join(f"{LABELS[name]} {mode}" for name in MODES for mode in ("eager", "compiled"))
    lines = [
        f"| tokens | step | {models} | MHLA compiled / eager | MHLA compiled / linear compiled |",
        "|---:|---|" + "---:|" * (2 * len(MODES) + 2),
    ]
    for tokens, r in results.items():
        for kind in ("train", "infer"):
            cells = " | ".join(
                f"{r[kind]['items_s'][name + suffix]:.2f}" for name in MODES for suffix in ("", COMPILED)
            )
            ratios = " | ".join(f"{r[kind]['ratio'][pair]:.2f}x" for pair in COMPILE_RATIOS)
            lines.append(f"| {tokens} | {kind} | {cells} | {ratios} |")
    return "\n".join(lines)


def breakdown_markdown(results) -> str:
    lines = [
        "| tokens | softmax attn (ms/step) | linear attn | MHLA attn | MHLA − linear attn "
        "| softmax rest (ms/step) | linear rest | MHLA rest |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tokens, r in results.items():
        attn, rest = r["infer"]["attention_ms"], r["infer"]["rest_ms"]
        attn_cells = " | ".join(f"{attn[name]:.2f}" for name in MODES)
        rest_cells = " | ".join(f"{rest[name]:.2f}" for name in MODES)
        lines.append(f"| {tokens} | {attn_cells} | {attn['mhla'] - attn['linear']:+.2f} | {rest_cells} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    models = build_models(args.depth, args.blocks, args.device, dtype, args.heads, args.head_dim)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    if args.compile:
        # The three twins share DiT's forward code object, and each (model, grad mode, token count) is a
        # graph of its own: dynamo's default limit of 8 per code object would silently run the rest
        # eagerly (it did, for 1024 tokens after 256). Room for all of them, and an error beyond.
        torch._dynamo.config.recompile_limit = 2 * len(MODES) * len(args.tokens) + 2
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        models.update({name + COMPILED: torch.compile(models[name], dynamic=False) for name in MODES})
    results = {}
    for tokens in args.tokens:
        results[tokens] = bench_size(models, optimizers, tokens, args, dtype)
        print(f"done {tokens} tokens", file=sys.stderr, flush=True)

    print(
        f"DiT, hidden {args.heads * args.head_dim} = {args.heads} heads x {args.head_dim}, patch 2, "
        f"depth {args.depth}, batch {args.batch}, {args.dtype}, "
        f"{args.device}, {torch.get_num_threads()} threads, medians of {args.reps} interleaved repetitions "
        f"(samples >= {args.min_sample_s} s); "
        f"MHLA blocks {tuple(args.blocks)}; linear = diffusers SanaLinearAttnProcessor2_0; "
        f"torch {torch.__version__}\n"
    )
    print("Training step (forward + backward + AdamW):\n")
    print(markdown(results, "train"))
    print("\nInference (forward):\n")
    print(markdown(results, "infer"))
    if args.compile:
        print("\nEager vs torch.compile (inductor), items/s; ratios: medians of paired time ratios:\n")
        print(compile_markdown(results))
    if args.attention_breakdown:
        print("\nInference step split into self-attention (attn1: projections + kernel) and the rest:\n")
        print(breakdown_markdown(results))


if __name__ == "__main__":
    run_cli(main)
