"""Wan's RoPE of q and k: the plain reference against the lean PyTorch path and the Triton kernel.

    python benchmarks/bench_rope.py                                # CUDA, Wan2.1-1.3B at 480p, bf16
    python benchmarks/bench_rope.py --dtype fp32                   # the after_phi_numerator / SANA-Video case
    python benchmarks/bench_rope.py --device cpu --tokens 64 --repeats 1   # plumbing (the tests run it)

What the MHLA processors call per layer (``mhla_gen.ops.rope.wan_rotary_pair``): q and k of shape
``(B, H, N, d)`` as heads-interleaved views of ``(B, N, H·d)`` projections, Wan's ``(1, N, 1, d)`` tables.
Prints a Markdown table: per backend, the median time of the forward (no grad) and of forward +
backward, the effective bandwidth of the forward (q, k read once and written once: what the kernel
moves; the reference moves about six times more), the speed-up over the reference, and whether the
forward gave the reference's bits (it should: a "NO" is a bug to report; the times are printed anyway).
The Triton backend runs on CUDA
(or on CPU under ``TRITON_INTERPRET=1``); elsewhere its row says why it is missing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from mhla_gen.commands.cli import device_setting
from mhla_gen.errors import ConfigError
from mhla_gen.ops.rope import wan_rotary_pair

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BACKENDS = ("reference", "pytorch", "triton")


def make_inputs(batch: int, heads: int, tokens: int, dim: int, dtype, table_dtype, device):
    """q, k ``(B, H, N, d)`` heads-interleaved (as the processors pass them) and Wan-like tables."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, tokens, heads * dim, generator=gen).to(device, dtype) for _ in range(2))
    q, k = (x.unflatten(-1, (heads, dim)).transpose(1, 2) for x in (q, k))
    angles = torch.rand(tokens, dim // 2, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = (f(angles).repeat_interleave(2, -1).view(1, tokens, 1, dim) for f in (torch.cos, torch.sin))
    return q, k, cos.to(device, table_dtype), sin.to(device, table_dtype)


def time_ms(fn, device, repeats: int) -> float:
    """Median wall time of ``fn`` in ms (after one warm-up call), synchronising CUDA around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def backend_missing(backend: str, device) -> str | None:
    """Why ``backend`` cannot run here, or None."""
    if backend != "triton":
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"needs CUDA (or TRITON_INTERPRET=1) on {device.type}"
    return None


def measure(backend: str, q, k, cos, sin, expected, repeats: int) -> tuple[float, float, bool]:
    """(forward ms, forward + backward ms, whether the forward equals ``expected`` bit for bit)."""
    with torch.no_grad():
        got = wan_rotary_pair(q, k, cos, sin, backend=backend)
    same = all(torch.equal(a, b) for a, b in zip(got, expected))
    qg, kg = (x.detach().requires_grad_() for x in (q, k))
    grads = tuple(torch.randn_like(x) for x in (q, k))

    def forward():
        with torch.no_grad():
            wan_rotary_pair(q, k, cos, sin, backend=backend)

    def forward_backward():
        outs = wan_rotary_pair(qg, kg, cos, sin, backend=backend)
        torch.autograd.backward(outs, grads)

    return time_ms(forward, q.device, repeats), time_ms(forward_backward, q.device, repeats), same


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--table-dtype", choices=sorted(DTYPES), default="fp32",
                        help="dtype of the cos/sin tables (bf16: a model cast with .to(bf16))")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=32760, help="21 x 30 x 52: Wan 480p, 81 frames")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if args.dim % 2:
        parser.error(f"--dim {args.dim} must be even (RoPE rotates coordinate pairs)")
    try:
        device = device_setting(args.device, hint="--device cpu runs the plumbing")
    except ConfigError as error:
        print(f"bench_rope: {error}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    q, k, cos, sin = make_inputs(args.batch, args.heads, args.tokens, args.dim, dtype,
                                 DTYPES[args.table_dtype], device)
    with torch.no_grad():
        expected = wan_rotary_pair(q, k, cos, sin, backend="reference")
    moved = 4 * q.numel() * q.element_size()  # q, k read once, rq, rk written once
    print(f"device={device} dtype={args.dtype} tables={args.table_dtype} B={args.batch} H={args.heads} "
          f"N={args.tokens} d={args.dim} repeats={args.repeats} torch={torch.__version__}")
    print("times in ms (median); GB/s = (q, k read + rq, rk written) / forward time\n")
    print("| backend | fwd | fwd+bwd | fwd GB/s | fwd vs reference | fwd+bwd vs reference | same bits |")
    print("|---|---:|---:|---:|---:|---:|---|")
    base = None
    for backend in BACKENDS:
        missing = backend_missing(backend, device)
        if missing:
            print(f"| {backend} | - | - | - | {missing} | | |")
            continue
        fwd, fwd_bwd, same = measure(backend, q, k, cos, sin, expected, args.repeats)
        base = base or (fwd, fwd_bwd)
        print(f"| {backend} | {fwd:.3f} | {fwd_bwd:.3f} | {moved / fwd / 1e6:.1f} | "
              f"{base[0] / fwd:.2f}x | {base[1] / fwd_bwd:.2f}x | {'yes' if same else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
