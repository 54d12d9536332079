"""Host time per MHLA call, layer by layer: what each wrapper adds on top of the backend's own work.

    python benchmarks/bench_host_overhead.py                      # CPU: PyTorch backend, B=1, H=1, N=16
    python benchmarks/bench_host_overhead.py --device cuda        # CUDA: Triton and PyTorch, + DiT-XL/2 shape

Layers (table rows), each timed for a forward (no grad) and a forward + backward (q, k, v and the mixing
matrix need gradients; ``torch.autograd.grad`` with a fixed output gradient):

- ``backend``: the backend module's ``forward`` (and ``backward``) called directly, under no_grad: the
  work itself, no wrapper;
- ``op``: ``torch.ops.mhla_gen.mhla`` with its registered autograd formula (what compiled graphs run);
- ``mhla_attention``: the public call in eager mode (checks, backend choice, then the eager path of
  ``mhla_gen/ops/mhla.py``: the backend directly, or through a lean autograd.Function);
- ``mhla_attention via op``: the public call forced through the registered op (the eager path switched
  off: how every eager call ran before 2026-11-28);
- ``autograd path``: ``mhla_attention_autograd``, the same math in plain differentiable torch ops.

"overhead" is a row's time minus the ``backend`` row's (medians of the per-repetition differences).

Timing: ``--reps`` repetitions; in each, every layer runs ``--calls`` calls back to back, the layers in
rotating order (interleaved, so a machine that slows down hurts all alike); a layer's time per call is the
median over repetitions of (sample time / calls). On CPU the default is many one-call samples (400 x 1): on
a shared machine a sample long enough to be preempted is an outlier the median drops, where a long sample
would carry other processes' time in every repetition. On CUDA a sample ends with a synchronize, so 20
back-to-back calls take the longer of the host's and the GPU's time per call; the "enqueue" columns time one
call started with the GPU idle (synchronize first, nothing inside the timing waits for the GPU): the host time
the GPU waits on, which is what sets the speed at small N (the target: at most 30 µs for an MHLA forward
at DiT-XL/2's shape). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from mhla_gen import BlockLayout, locality_init, mhla_attention
from mhla_gen.commands.cli import device_setting
from mhla_gen.commands.cli import run as run_cli
from mhla_gen.ops import mhla as mhla_module
from mhla_gen.ops import mhla_attention_autograd

# name -> (batch, heads, head dim, token grid, blocks)
SHAPES = {
    "tiny": (1, 1, 16, (4, 4), (2, 2)),  # 16 tokens: nothing but host time
    "dit256": (2, 16, 72, (16, 16), (4, 4)),  # DiT-XL/2 at 256 px
}
LAYERS = ("backend", "op", "mhla_attention", "mhla_attention via op", "autograd path")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-6


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--backends", nargs="+", choices=("pytorch", "triton"), default=None,
                        help="default: pytorch on CPU; triton and pytorch on CUDA")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None,
                        help="default: tiny on CPU; tiny and dit256 on CUDA")
    parser.add_argument("--reps", type=int, default=None,
                        help="interleaved repetitions (default 400 on CPU, 30 on CUDA)")
    parser.add_argument("--calls", type=int, default=None,
                        help="back-to-back calls per sample (default 1 on CPU, 20 on CUDA)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    args.device = device_setting(args.device)
    cuda = args.device.type == "cuda"
    args.reps = (30 if cuda else 400) if args.reps is None else args.reps
    args.calls = (20 if cuda else 1) if args.calls is None else args.calls
    if min(args.reps, args.calls) < 1:
        parser.error(f"--reps and --calls must be at least 1, got {args.reps} and {args.calls}")
    if args.backends is None:
        args.backends = ["triton", "pytorch"] if cuda else ["pytorch"]
    if "triton" in args.backends and not cuda:
        parser.error("--backends triton needs --device cuda (the kernels run on CUDA tensors)")
    args.shapes = args.shapes or (["tiny", "dit256"] if cuda else ["tiny"])
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_calls(shape: str, backend: str, device, dtype) -> tuple[dict, dict]:
    """``({layer: forward call}, {layer: forward + backward call})`` at one shape, for one backend."""
    b, h, d, grid, blocks = SHAPES[shape]
    layout = BlockLayout(grid, blocks)
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(b, layout.num_tokens, h, d, generator=gen).to(device, dtype).transpose(1, 2)
                  for _ in range(4))  # heads-interleaved, as the processors pass them
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    mixing = locality_init(layout).to(device, torch.float32).requires_grad_()
    inputs = (q, k, v, mixing)
    module = mhla_module._backend_module(backend)
    grid_list, blocks_list = list(grid), list(blocks)

    def backend_forward():
        with torch.no_grad():
            return module.forward(q, k, v, grid_list, blocks_list, mixing, "relu", True, EPS)

    def backend_forward_backward():
        out, *saved = backend_forward()
        with torch.no_grad():
            module.backward(g, q, k, v, grid_list, blocks_list, mixing, "relu", True, EPS, out, *saved,
                            [True] * 4)

    def op(*xs):
        return torch.ops.mhla_gen.mhla(xs[0], xs[1], xs[2], grid_list, blocks_list, xs[3], "relu", True, EPS,
                                       backend)[0]

    def public(*xs):
        return mhla_attention(xs[0], xs[1], xs[2], layout, xs[3], backend=backend)

    def via_op(*xs):  # the eager path switched off for this call (an attribute swap: no timing cost)
        eager_check = mhla_module._plain_eager_call
        mhla_module._plain_eager_call = _never
        try:
            return public(*xs)
        finally:
            mhla_module._plain_eager_call = eager_check

    def autograd_path(*xs):
        return mhla_attention_autograd(xs[0], xs[1], xs[2], layout, xs[3])

    forward, forward_backward = {"backend": backend_forward}, {"backend": backend_forward_backward}
    for name, fn in zip(LAYERS[1:], (op, public, via_op, autograd_path)):
        forward[name] = _no_grad(fn, inputs)
        forward_backward[name] = _with_grad(fn, inputs, g)
    return forward, forward_backward


def _never(*args) -> bool:
    return False


def _no_grad(fn, inputs) -> Callable[[], object]:
    def call():
        with torch.no_grad():
            return fn(*inputs)

    return call


def _with_grad(fn, inputs, grad_out) -> Callable[[], object]:
    return lambda: torch.autograd.grad(fn(*inputs), inputs, grad_out)


def per_call_us(calls: dict[str, Callable], args) -> tuple[dict[str, list[float]], dict[str, float]]:
    """``({layer: µs per call per repetition}, {layer: median enqueue µs (CUDA) or nan})``."""
    names = list(calls)
    for fn in calls.values():  # warm-up: caches, allocator, compiled kernels
        for _ in range(3):
            fn()
    sync(args.device)
    samples = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            sync(args.device)
            start = time.perf_counter()
            for _ in range(args.calls):
                calls[name]()
            sync(args.device)
            samples[name].append((time.perf_counter() - start) * 1e6 / args.calls)
    enqueue = {name: float("nan") for name in names}
    if args.device.type == "cuda":
        enqueue = {name: enqueue_us(calls[name], args.device, args.reps) for name in names}
    return samples, enqueue


def enqueue_us(fn: Callable, device, calls: int) -> float:
    """Median host µs of one call started with the GPU idle (nothing inside the timing waits for it)."""
    times = []
    for _ in range(calls):
        sync(device)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    sync(device)
    return statistics.median(times)


def table_rows(shape: str, backend: str, args) -> list[str]:
    dtype = DTYPES[args.dtype]
    forward, forward_backward = layer_calls(shape, backend, args.device, dtype)
    fwd, fwd_enqueue = per_call_us(forward, args)
    fb, fb_enqueue = per_call_us(forward_backward, args)
    b, h, d, grid, blocks = SHAPES[shape]
    label = f"{shape} ({b}×{h}×{d}, grid {'x'.join(map(str, grid))}, blocks {'x'.join(map(str, blocks))})"
    rows = []
    for name in LAYERS:
        cells = [backend, label, f"`{name}`"]
        for samples in (fwd, fb):
            extra = statistics.median(t - base for t, base in zip(samples[name], samples["backend"]))
            overhead = "–" if name == "backend" else f"{extra:+.1f}"
            cells += [f"{statistics.median(samples[name]):.1f}", overhead]
        if args.device.type == "cuda":
            cells += [f"{fwd_enqueue[name]:.1f}", f"{fb_enqueue[name]:.1f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.type == "cuda"
    print(f"MHLA host time per call: device {args.device}, {args.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, ReLU features with the normaliser; µs per call, medians of "
          f"{args.reps} interleaved repetitions of {args.calls} calls; overhead = layer − backend\n")
    head = "| backend | shape | layer | fwd µs | fwd overhead | f+b µs | f+b overhead |"
    head += " fwd enqueue µs | f+b enqueue µs |" if cuda else ""
    print(head)
    print("|" + "---|" * 3 + "---:|" * (head.count("|") - 4))
    for backend in args.backends:
        for shape in args.shapes:
            print("\n".join(table_rows(shape, backend, args)), flush=True)
            print(f"timed {backend} {shape}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    run_cli(main)
