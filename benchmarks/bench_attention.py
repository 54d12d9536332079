r"""Speed and memory of MHLA against plain linear attention and softmax attention (SDPA).

Prints one Markdown table row per (N, M) with the forward time, forward+backward time and peak memory
of SDPA (``F.scaled_dot_product_attention``), plain linear attention (``φ(q)(φ(k)ᵀv) / (φ(q)Σφ(k)+eps)``,
fp32 accumulation like the MHLA path) and MHLA (:func:`mhla_gen.mhla_attention`) on a square 2D token
grid ``√N × √N`` cut into ``√M × √M`` blocks.

Timing: every repetition runs all methods of one ``N`` back to back (interleaved), so a machine that
slows down hurts all of them alike. Each timed call directly follows an untimed call of the same
method: otherwise whichever method runs first after a large free (SDPA's N×N matrix) pays for
re-growing the allocator's heap (page faults, tens of ms on CPU) and the next one reuses its pages.
Times are medians; ratios are medians of the per-repetition
ratios. "fwd" runs under ``torch.no_grad()`` (inference); "fwd+bwd" takes the gradients of q, k, v
(and the mixing matrix) for a fixed random output gradient.

Peak memory (forward+backward; per method one warm-up call, then one measured call, untimed):

* CUDA: ``torch.cuda.max_memory_allocated()`` minus the allocated memory before the call.
* CPU: the kernel's peak resident set size. Before the call we ``malloc_trim(0)``, then write ``5`` to
  ``/proc/self/clear_refs`` (resets ``VmHWM`` to the current RSS) and read ``VmRSS``; after the call
  we read ``VmHWM`` from ``/proc/self/status``. Peak = VmHWM − VmRSS before. glibc is told to serve
  every allocation above 128 KiB with ``mmap`` (``mallopt(M_MMAP_THRESHOLD)``, which also stops the
  threshold from growing), so freed tensors leave the RSS at once and reuse of freed heap memory
  does not hide allocations. Inputs are allocated before the call and are not counted. This
  setting must precede any heap growth and slows big allocations down (each one page-faults), so
  on CPU the memory is measured in a separate, freshly spawned process; timings run under the
  default allocator.

Page faults on CPU: glibc maps every buffer above 32 MiB afresh and unmaps it when it is freed, so at
the Wan grid a forward+backward faults in gigabytes of zeroed pages (a whole ``--grids`` run spent
more system time than user time) and single timings swing by up to 2×. Run with

    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295

to keep freed memory in the heap (nothing is faulted twice): the timings then measure the code rather
than the kernel's page zeroing. The peak-memory process resets ``mmap_max`` to glibc's default, so its
numbers are the same under that setting.

Example (the README table; CPU fp32, B=1, 4 heads, d=64):

    python benchmarks/bench_attention.py --device cpu --dtype fp32 --repeats 5 \
        --sizes 1024 4096 16384 --blocks 4 16 64 256 --skip-sdpa-above 4096 --out bench.json

Grids (``--grids GRID:BLOCKS ...``): linear attention and MHLA on each listed token grid, all timed side
by side, with MHLA's time per token against the first case's. The README's uneven-grid table (the Wan
480p latent grid against an evenly divisible one, Wan-1.3B heads, CPU fp32):

    python benchmarks/bench_attention.py --device cpu --heads 12 --dim 128 --repeats 5 \
        --grids 21x30x50:3x5x10 21x30x52:3x5x10

Model shapes (``--shapes``; the default on CUDA): the attention layers of the real models, batch 2 (CFG),
heads-interleaved inputs as the processors pass them, ReLU features with the normaliser, a learnable
locality-initialised mixing matrix. Side by side: SDPA (FlashAttention backend for bf16/fp16), SANA's
linear attention, the registered op with its PyTorch implementation (``backend="pytorch"``), the
registered op as it dispatches (:func:`mhla_gen.mhla_attention`: the Triton kernels on CUDA) and the
Triton kernels called directly (``mhla_gen.ops.triton_mhla``, CUDA only). CUDA times come from CUDA
events over enough back-to-back calls for >= 20 ms per sample. Achieved bandwidth counts the bytes
MHLA cannot avoid: forward q, k, v read and the output written (4 tensors); forward+backward adds q, k,
v and the output gradient read and dq, dk, dv written (11 tensors). It is printed as a fraction of a
measured device-to-device copy (1 GiB, read + write):

    python benchmarks/bench_attention.py --device cuda --dtype bf16 --out bench_cuda.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import multiprocessing
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mhla_gen import BlockLayout, locality_init, mhla_attention
from mhla_gen.commands.cli import device_setting, expand_path
from mhla_gen.commands.cli import run as run_cli
from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import check_file_target, file_record
from mhla_gen.outputs.locks import writing_files
from mhla_gen.train.io import atomic_write_text

BENCH_KIND = "benchmark"  # the record in the --out JSON (mhla_gen.outputs.folders.file_record)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def linear_attention(q, k, v, eps: float = 1e-6):
    """Plain global linear attention with ReLU features; fp32 accumulation for half inputs."""
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    fq, fk = F.relu(q.to(acc)), F.relu(k.to(acc))
    kv = fk.transpose(-1, -2) @ v.to(acc)  # (B, H, d, e)
    den = fq @ fk.sum(dim=-2).unsqueeze(-1)  # (B, H, N, 1)
    return ((fq @ kv) / (den + eps)).to(q.dtype)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


# --------------------------------------------------------------------------------------------------
# measurement


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(fn, inputs, device) -> float:
    with torch.no_grad():
        _sync(device)
        start = time.perf_counter()
        fn(*inputs)
        _sync(device)
    return time.perf_counter() - start


def time_forward_backward(fn, inputs, grad_out, device) -> float:
    _sync(device)
    start = time.perf_counter()
    out = fn(*inputs)
    torch.autograd.grad(out, [x for x in inputs if x.requires_grad], grad_out)
    _sync(device)
    return time.perf_counter() - start


class PeakMemory:
    """Peak bytes allocated by one call (CUDA allocator stats, or the kernel's RSS high-water mark on CPU).

    On CPU, creating it fixes glibc's mmap threshold for the rest of the process (see the module
    docstring), which also changes allocation speed: create it only after all timings are taken.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.libc = None
        if device.type == "cpu" and sys.platform.startswith("linux"):
            self.libc = ctypes.CDLL("libc.so.6")
            m_mmap_threshold, m_mmap_max = -3, -4
            self.libc.mallopt(m_mmap_threshold, 128 * 1024)
            # glibc's default; GLIBC_TUNABLES=glibc.malloc.mmap_max=0 (the README's kept-memory timings)
            # would otherwise put every buffer on the heap, and its holes would count as peak
            self.libc.mallopt(m_mmap_max, 65536)

    @staticmethod
    def _status_kib(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise RuntimeError(f"{field} not found in /proc/self/status")

    def measure(self, call) -> float:
        """Run ``call()`` once; return its peak extra memory in MiB (nan where unsupported)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            call()
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - before) / 2**20
        if self.libc is None:
            return math.nan
        self.libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        before = self._status_kib("VmRSS")
        call()
        return (self._status_kib("VmHWM") - before) / 1024


def square_side(n: int) -> int:
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"--sizes must be perfect squares (square 2D grid), got {n}")
    return side


def build_methods(n: int, args, device, dtype):
    """``({name: (fn, inputs, with_backward)}, grad_out)`` for one sequence length."""
    side = square_side(n)
    shape = (args.batch, args.heads, n, args.dim)
    gen = torch.Generator(device="cpu").manual_seed(n)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    grad_out = torch.randn(shape, generator=gen).to(device, dtype)

    methods = {}
    if not args.no_sdpa:
        methods["sdpa"] = (sdpa, (q, k, v), n <= args.skip_sdpa_above)
    methods["la"] = (linear_attention, (q, k, v), True)
    for m in args.blocks:
        b = square_side(m)
        if b > side:
            print(f"skip M={m}: more blocks per axis than the {side}x{side} grid has", file=sys.stderr)
            continue
        layout = BlockLayout((side, side), (b, b))
        mixing = locality_init(layout).to(device, dtype=torch.float32).requires_grad_()  # learnable
        fn = lambda q_, k_, v_, w_, layout=layout: mhla_attention(q_, k_, v_, layout, w_)  # noqa: E731
        methods[f"mhla{m}"] = (fn, (q, k, v, mixing), True)
    return methods, grad_out


def time_size(n: int, args, device, dtype) -> list[dict]:
    """Interleaved timings of every method at one ``N``; one row per ``M``."""
    methods, grad_out = build_methods(n, args, device, dtype)
    fwd = {name: [] for name in methods}
    fwd_bwd = {name: [] for name in methods if methods[name][2]}
    for rep in range(args.warmup + args.repeats):
        for name, (fn, inputs, backward) in methods.items():
            time_forward(fn, inputs, device)  # allocator warm-up for this method (see module docstring)
            t_fwd = time_forward(fn, inputs, device)
            t_fb = None
            if backward:
                time_forward_backward(fn, inputs, grad_out, device)
                t_fb = time_forward_backward(fn, inputs, grad_out, device)
            if rep >= args.warmup:
                fwd[name].append(t_fwd)
                if backward:
                    fwd_bwd[name].append(t_fb)

    def med(times, name):
        return statistics.median(times[name]) * 1e3 if name in times else math.nan

    def ratio(times, a, b):
        if a not in times or b not in times:
            return math.nan
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    rows = []
    for m in args.blocks:
        name = f"mhla{m}"
        if name in methods:
            rows.append({
                "N": n, "M": m,
                "sdpa_fwd_ms": med(fwd, "sdpa"), "sdpa_fwd_bwd_ms": med(fwd_bwd, "sdpa"),
                "la_fwd_ms": med(fwd, "la"), "la_fwd_bwd_ms": med(fwd_bwd, "la"),
                "mhla_fwd_ms": med(fwd, name), "mhla_fwd_bwd_ms": med(fwd_bwd, name),
                "mhla_over_la_fwd": ratio(fwd, name, "la"),
                "mhla_over_la_fwd_bwd": ratio(fwd_bwd, name, "la"),
                "sdpa_over_mhla_fwd": ratio(fwd, "sdpa", name),
            })
    return rows


def measure_memory(args) -> dict[int, dict[str, float]]:
    """``{N: {method: peak MiB}}`` of one forward+backward call per method (after one warm-up call).

    On CPU this runs in a fresh child process (see :func:`main`): the allocator setting it needs
    must be made before the heap has grown, and must not slow down the timings.
    """
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = PeakMemory(device)
    result = {}
    for n in args.sizes:
        methods, grad_out = build_methods(n, args, device, dtype)
        result[n] = {}
        for name, (fn, inputs, backward) in methods.items():
            if backward:
                call = lambda fn=fn, inputs=inputs, g=grad_out: time_forward_backward(fn, inputs, g, device)  # noqa: E731
                call()  # warm-up: first-call allocations (thread pools, caches) are not the operator's
                result[n][name] = peak.measure(call)
    return result


def markdown(rows: list[dict]) -> str:
    head = ("| N | M | SDPA fwd | SDPA f+b | LA fwd | LA f+b | MHLA fwd | MHLA f+b | MHLA/LA fwd | "
            "MHLA/LA f+b | SDPA/MHLA fwd | peak SDPA | peak LA | peak MHLA | peak MHLA/LA |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(x, unit=""):
        return "–" if x is None or math.isnan(x) else f"{x:.1f}{unit}" if x >= 10 else f"{x:.2f}{unit}"

    for r in rows:
        peak_ratio = r["peak_mib_mhla"] / r["peak_mib_la"] if r["peak_mib_la"] > 0 else math.nan
        lines.append(
            f"| {r['N']} | {r['M']} | {f(r['sdpa_fwd_ms'])} | {f(r['sdpa_fwd_bwd_ms'])} "
            f"| {f(r['la_fwd_ms'])} "
            f"| {f(r['la_fwd_bwd_ms'])} | {f(r['mhla_fwd_ms'])} | {f(r['mhla_fwd_bwd_ms'])} "
            f"| {f(r['mhla_over_la_fwd'], '×')} | {f(r['mhla_over_la_fwd_bwd'], '×')} "
            f"| {f(r['sdpa_over_mhla_fwd'], '×')} | {f(r['peak_mib_sdpa'])} | {f(r['peak_mib_la'])} "
            f"| {f(r['peak_mib_mhla'])} | {f(peak_ratio, '×')} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# any token grid (``--grids``): uneven against even grids, side by side


def parse_grid_case(text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``"21x30x52:3x5x10"`` -> ``((21, 30, 52), (3, 5, 10))`` (token grid : blocks per axis)."""
    try:
        grid, blocks = (tuple(int(x) for x in part.split("x")) for part in text.split(":"))
    except ValueError:
        message = f"--grids takes GRID:BLOCKS such as 21x30x52:3x5x10, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if len(grid) != len(blocks) or min(grid + blocks) < 1 or any(b > g for g, b in zip(grid, blocks)):
        raise argparse.ArgumentTypeError(f"--grids {text!r}: blocks must fit the grid, axis by axis")
    return grid, blocks


def build_grid_methods(cases, args, device, dtype):
    """``{(case, method): (fn, inputs, grad_out)}``: plain linear attention and MHLA on each grid case's
    own q, k, v ``(B, H, N, d)`` (heads-interleaved memory, as the processors pass them)."""
    methods = {}
    for grid, blocks in cases:
        layout = BlockLayout(grid, blocks)
        b, h, n, d = args.batch, args.heads, layout.num_tokens, args.dim
        gen = torch.Generator().manual_seed(n)
        q, k, v, g = (torch.randn(b, n, h, d, generator=gen).to(device, dtype) for _ in range(4))
        q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))  # (B, H, N, d) on (B, N, H, d) memory
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        mixing = locality_init(layout).to(device, torch.float32).requires_grad_()
        case = "x".join(map(str, grid)) + ":" + "x".join(map(str, blocks))
        methods[case, "la"] = (lambda q_, k_, v_: linear_attention(q_, k_, v_), (q, k, v), g)
        mhla = lambda q_, k_, v_, w_, layout=layout: mhla_attention(q_, k_, v_, layout, w_)  # noqa: E731
        methods[case, "mhla"] = (mhla, (q, k, v, mixing), g)
    return methods


def time_grids(args, device, dtype) -> dict:
    """``{(case, method, mode): [seconds per repetition]}``, every method of every case interleaved."""
    methods = build_grid_methods(args.grids, args, device, dtype)
    times = {(case, method, mode): [] for case, method in methods for mode in ("fwd", "fwd_bwd")}
    for rep in range(args.warmup + args.repeats):
        for (case, method), (fn, inputs, grad_out) in methods.items():
            time_forward(fn, inputs, device)  # allocator warm-up (see the module docstring)
            t_fwd = time_forward(fn, inputs, device)
            time_forward_backward(fn, inputs, grad_out, device)
            t_fb = time_forward_backward(fn, inputs, grad_out, device)
            if rep >= args.warmup:
                times[case, method, "fwd"].append(t_fwd)
                times[case, method, "fwd_bwd"].append(t_fb)
    return times


def measure_grid_memory(args) -> dict:
    """``{(case, method): peak MiB}`` of one forward+backward call (fresh process on CPU, as
    :func:`measure_memory`)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = PeakMemory(device)
    result = {}
    for key, (fn, inputs, grad_out) in build_grid_methods(args.grids, args, device, dtype).items():
        call = lambda fn=fn, inputs=inputs, g=grad_out: time_forward_backward(fn, inputs, g, device)  # noqa: E731
        call()
        result[key] = peak.measure(call)
    return result


def grids_markdown(args, times: dict, memory: dict) -> str:
    """Per grid case: LA and MHLA times and peaks, MHLA / LA (and the flop ratio 1 + M²/(2N) of the
    mixing GEMMs), and each case's MHLA per token against the first case's (the reference grid)."""
    head = ("| grid : blocks | N | M | LA fwd | MHLA fwd | LA f+b | MHLA f+b | MHLA/LA fwd | MHLA/LA f+b "
            "| 1 + M²/2N | peak LA | peak MHLA | peak MHLA/LA | MHLA per token vs first fwd | … f+b |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(a, b))  # noqa: E731
    first = None
    for grid, blocks in args.grids:
        case = "x".join(map(str, grid)) + ":" + "x".join(map(str, blocks))
        n, m = math.prod(grid), math.prod(blocks)
        med = {key[1:]: statistics.median(ts) * 1e3 for key, ts in times.items() if key[0] == case}
        first = first or (case, n)
        per_token = [
            ratio(times[case, "mhla", mode], times[first[0], "mhla", mode]) * first[1] / n
            for mode in ("fwd", "fwd_bwd")
        ]
        peaks = memory[case, "la"], memory[case, "mhla"]
        lines.append(
            f"| {case} | {n} | {m} | {med['la', 'fwd']:.1f} | {med['mhla', 'fwd']:.1f} "
            f"| {med['la', 'fwd_bwd']:.1f} | {med['mhla', 'fwd_bwd']:.1f} "
            f"| {ratio(times[case, 'mhla', 'fwd'], times[case, 'la', 'fwd']):.2f}× "
            f"| {ratio(times[case, 'mhla', 'fwd_bwd'], times[case, 'la', 'fwd_bwd']):.2f}× "
            f"| {1 + m * m / (2 * n):.2f} | {peaks[0]:.0f} | {peaks[1]:.0f} | {peaks[1] / peaks[0]:.2f}× "
            f"| {per_token[0]:.2f}× | {per_token[1]:.2f}× |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# model shapes (CUDA)


@dataclass(frozen=True)
class ModelShape:
    """One attention layer: batch, heads x head dim, token grid and MHLA blocks."""

    batch: int
    heads: int
    dim: int
    grid: tuple[int, ...]
    blocks: tuple[int, ...]


MODEL_SHAPES = {
    "wan480": ModelShape(2, 12, 128, (21, 30, 52), (3, 5, 10)),  # Wan2.1-1.3B, 480p: 32,760 tokens
    "sana4096": ModelShape(2, 70, 32, (128, 128), (4, 4)),  # SANA-1.6B, 4096 px: 16,384 tokens
    "dit256": ModelShape(2, 16, 72, (16, 16), (4, 4)),  # DiT-XL/2, 256 px
    "dit512": ModelShape(2, 16, 72, (32, 32), (4, 4)),  # DiT-XL/2, 512 px
}
MODEL_METHODS = ("sdpa", "la", "mhla_torch", "mhla_op", "mhla_triton")


class _TritonMHLA(torch.autograd.Function):
    """The Triton entry points behind autograd (ReLU, normalised), independent of the op's dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, mixing, grid, blocks):
        from mhla_gen.ops import triton_mhla

        out, *saved = triton_mhla.forward(q, k, v, grid, blocks, mixing, "relu", True, 1e-6)
        ctx.save_for_backward(q, k, v, mixing, out, *saved)
        ctx.layout = (grid, blocks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from mhla_gen.ops import triton_mhla

        q, k, v, mixing, out, *saved = ctx.saved_tensors
        grads = triton_mhla.backward(grad_out, q, k, v, *ctx.layout, mixing, "relu", True, 1e-6, out, *saved,
                                     ctx.needs_input_grad[:4])
        return (*grads, None, None)


def time_ms(fn, device: torch.device, min_sample_ms: float = 20.0) -> float:
    """Milliseconds per call of ``fn`` in one sample: CUDA events around enough back-to-back calls for
    ``min_sample_ms`` (after one call that sizes the sample); one perf_counter call on CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    events[0].record()
    fn()
    events[1].record()
    events[1].synchronize()
    calls = max(1, math.ceil(min_sample_ms / max(events[0].elapsed_time(events[1]), 1e-3)))
    events[0].record()
    for _ in range(calls):
        fn()
    events[1].record()
    events[1].synchronize()
    return events[0].elapsed_time(events[1]) / calls


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of ``nbytes``), median of 5 samples."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / (statistics.median(time_ms(lambda: dst.copy_(src), device) for _ in range(5)) * 1e-3)


def pytorch_mhla(q, k, v, layout, mixing):
    """The registered op with its PyTorch implementation (``blocked.py``) also on CUDA (the backward
    follows what the forward ran)."""
    return mhla_attention(q, k, v, layout, mixing, backend="pytorch")


def build_model_methods(shape: ModelShape, device, dtype):
    """``({name: fn}, inputs, grad_out)`` at one model shape; q, k, v heads-interleaved (processors')."""
    layout = BlockLayout(shape.grid, shape.blocks)
    b, h, n, d = shape.batch, shape.heads, layout.num_tokens, shape.dim
    q, k, v = (torch.randn(b, n, h, d, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
               for _ in range(3))
    grad_out = torch.randn(b, n, h, d, device=device, dtype=dtype).transpose(1, 2)
    mixing = locality_init(layout).to(device, torch.float32).requires_grad_()

    def flash(q_, k_, v_, w_):
        if dtype == torch.float32:  # FlashAttention has no fp32 kernel: let SDPA choose
            return sdpa(q_, k_, v_)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q_, k_, v_)

    methods = {
        "sdpa": flash,
        "la": lambda q_, k_, v_, w_: linear_attention(q_, k_, v_),
        "mhla_torch": lambda q_, k_, v_, w_: pytorch_mhla(q_, k_, v_, layout, w_),
        "mhla_op": lambda q_, k_, v_, w_: mhla_attention(q_, k_, v_, layout, w_),
    }
    if device.type == "cuda":
        methods["mhla_triton"] = lambda q_, k_, v_, w_: _TritonMHLA.apply(q_, k_, v_, w_, shape.grid,
                                                                          shape.blocks)
    return methods, (q, k, v, mixing), grad_out


def time_model_shape(name: str, shape: ModelShape, args, device, dtype, copy_bw: float) -> dict:
    """Interleaved fwd / fwd+bwd medians (ms) of every method at one model shape, plus MHLA bandwidths.

    A method that runs out of memory gets NaN (SDPA's math fallback, or the PyTorch path, at large N)."""
    methods, inputs, grad_out = build_model_methods(shape, device, dtype)
    samples = {(m, mode): [] for m in methods for mode in ("fwd", "fwd_bwd")}
    failed = set()

    def forward(fn):
        with torch.no_grad():
            fn(*inputs)

    def forward_backward(fn):
        torch.autograd.grad(fn(*inputs), inputs, grad_out, allow_unused=True)  # SDPA, LA: no mixing

    for _ in range(args.warmup + args.repeats):
        for method, fn in methods.items():
            for mode, call in (("fwd", forward), ("fwd_bwd", forward_backward)):
                if (method, mode) in failed:
                    continue
                try:
                    samples[method, mode].append(time_ms(lambda call=call, fn=fn: call(fn), device))
                except torch.cuda.OutOfMemoryError:
                    failed.add((method, mode))
                    print(f"{name}: {method} {mode} out of memory", file=sys.stderr)
                    torch.cuda.empty_cache()
    row = {"shape": name, **asdict(shape), "N": math.prod(shape.grid), "M": math.prod(shape.blocks)}
    for (method, mode), times in samples.items():
        times = [] if (method, mode) in failed else times[args.warmup:]
        row[f"{method}_{mode}_ms"] = statistics.median(times) if times else math.nan
    tensor_bytes = shape.batch * shape.heads * row["N"] * shape.dim * torch.finfo(dtype).bits // 8
    for mode, tensors in (("fwd", 4), ("fwd_bwd", 11)):
        for method in ("mhla_op", "mhla_triton"):
            ms = row.get(f"{method}_{mode}_ms", math.nan)
            row[f"{method}_{mode}_gbps"] = tensors * tensor_bytes / (ms * 1e-3) / 1e9
            row[f"{method}_{mode}_of_copy"] = tensors * tensor_bytes / (ms * 1e-3) / copy_bw
    return row


def model_markdown(rows: list[dict], mode: str) -> str:
    head = ("| shape | B×H×d | N | M | SDPA | LA | MHLA torch | MHLA op | MHLA Triton | SDPA/Triton "
            "| Triton GB/s | Triton / copy | op / copy |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(x, unit=""):
        return "–" if x is None or math.isnan(x) else f"{x:.1f}{unit}" if x >= 10 else f"{x:.3g}{unit}"

    for r in rows:
        ms = {m: r.get(f"{m}_{mode}_ms", math.nan) for m in MODEL_METHODS}
        triton_of_copy, op_of_copy = (100 * r[f"{m}_{mode}_of_copy"] for m in ("mhla_triton", "mhla_op"))
        lines.append(
            f"| {r['shape']} | {r['batch']}×{r['heads']}×{r['dim']} | {r['N']} | {r['M']} "
            + "".join(f"| {f(ms[m])} " for m in MODEL_METHODS)
            + f"| {f(ms['sdpa'] / ms['mhla_triton'], '×')} | {f(r[f'mhla_triton_{mode}_gbps'])} "
            f"| {f(triton_of_copy, '%')} | {f(op_of_copy, '%')} |"
        )
    return "\n".join(lines)


def run_model_shapes(args, device, dtype) -> tuple[str, list[dict]]:
    """The model-shape tables (forward, forward+backward) as text, and their rows."""
    copy_bw = copy_bandwidth(device) if device.type == "cuda" else math.nan
    rows = []
    for name in args.shapes:
        rows.append(time_model_shape(name, MODEL_SHAPES[name], args, device, dtype, copy_bw))
        print(f"timed {name}", file=sys.stderr)
    text = (f"model shapes: device-to-device copy {copy_bw / 1e9:.0f} GB/s; times in ms (median of "
            f"{args.repeats}); bandwidth = unavoidable bytes / time (fwd: q, k, v, out; f+b: 11 tensors)\n\n"
            f"forward (no grad)\n\n{model_markdown(rows, 'fwd')}\n\n"
            f"forward + backward (q, k, v, mixing)\n\n{model_markdown(rows, 'fwd_bwd')}")
    return text, rows


# --------------------------------------------------------------------------------------------------
# host vs GPU time (``--cuda-graphs``): eager calls beside the same calls replayed from CUDA graphs

GRAPH_METHODS = {"sdpa": "FlashAttention", "la": "LA", "mhla_op": "MHLA"}
GRAPH_BLOCKS = (4, 4)


def graph_ms(fn, device: torch.device) -> float:
    """GPU ms per call of ``fn`` replayed from a CUDA graph (no host work between its kernels): warm-up on
    a side stream, capture, then the median of 5 samples of back-to-back replays; NaN off CUDA."""
    if device.type != "cuda":
        return math.nan
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = statistics.median(time_ms(graph.replay, device) for _ in range(5))
    del graph  # its memory pool goes back before the next capture
    torch.cuda.empty_cache()
    return ms


def eager_and_graph_ms(shape: ModelShape, methods, device, dtype, repeats: int) -> dict:
    """``{(method, mode): (eager ms, CUDA-graph ms)}`` of each method's forward (no grad) and forward +
    backward (q, k, v and the mixing matrix) at one shape; eager is the median of ``repeats`` samples."""
    fns, inputs, grad_out = build_model_methods(shape, device, dtype)
    result = {}
    for method in methods:
        fn = fns[method]

        def forward(fn=fn):
            with torch.no_grad():
                fn(*inputs)

        def forward_backward(fn=fn):
            torch.autograd.grad(fn(*inputs), inputs, grad_out, allow_unused=True)  # SDPA, LA: no mixing

        for mode, call in (("fwd", forward), ("fwd_bwd", forward_backward)):
            eager = statistics.median(time_ms(call, device) for _ in range(repeats))
            try:
                graph = graph_ms(call, device)
            except Exception as err:  # noqa: BLE001 - a capture that fails is a finding; the table shows "–"
                print(f"{shape}: {method} {mode}: CUDA-graph capture failed: {err!r}", file=sys.stderr)
                graph = math.nan
            result[method, mode] = (eager, graph)
    return result


def graph_cases(args) -> dict[str, ModelShape]:
    """The model shapes of ``--shapes``, then square grids of ``--graph-sizes`` tokens in 4 x 4 blocks."""
    b, h, d = args.graph_shape
    cases = {name: MODEL_SHAPES[name] for name in args.shapes}
    for n in args.graph_sizes:
        side = square_side(n)
        cases[f"N={n}"] = ModelShape(b, h, d, (side, side), GRAPH_BLOCKS)
    return cases


def host_vs_gpu_markdown(times: dict[str, tuple[ModelShape, dict]]) -> str:
    head = ("| case | B×H×d | N | method | fwd eager | fwd graph | eager / graph | f+b eager | f+b graph "
            "| eager / graph |")
    lines = [head, "|---|---|---:|---|" + "---:|" * 6]
    for case, (shape, result) in times.items():
        for method, label in GRAPH_METHODS.items():
            cells = []
            for mode in ("fwd", "fwd_bwd"):
                eager, graph = result[method, mode]
                cells += [_ms(eager), _ms(graph), _ms(eager / graph, "×")]
            lines.append(f"| {case} | {shape.batch}×{shape.heads}×{shape.dim} | {math.prod(shape.grid)} "
                         f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms(x: float, unit: str = "") -> str:
    return "–" if math.isnan(x) else f"{x:.3g}{unit}" if x < 100 else f"{x:.0f}{unit}"


def crossover_markdown(times: dict[int, dict]) -> str:
    """MHLA against FlashAttention by N: times, ratios, and the N from which MHLA is faster."""
    lines = ["| N | mode | FA eager | MHLA eager | MHLA / FA eager | FA graph | MHLA graph "
             "| MHLA / FA graph |", "|---:|---|" + "---:|" * 6]
    for n, result in times.items():
        for mode, label in (("fwd", "fwd"), ("fwd_bwd", "f+b")):
            (fa_eager, fa_graph), (mhla_eager, mhla_graph) = result["sdpa", mode], result["mhla_op", mode]
            lines.append(f"| {n} | {label} | {_ms(fa_eager)} | {_ms(mhla_eager)} | "
                         f"{_ms(mhla_eager / fa_eager, '×')} | {_ms(fa_graph)} | {_ms(mhla_graph)} | "
                         f"{_ms(mhla_graph / fa_graph, '×')} |")
    lines.append("")
    for mode, label in (("fwd", "forward"), ("fwd_bwd", "forward + backward")):
        lines.append(f"- {label}: MHLA takes at most FlashAttention's time from N = "
                     f"{crossover_n(times, mode, 0)} eager, from N = {crossover_n(times, mode, 1)} in CUDA "
                     "graphs (GPU time)")
    return "\n".join(lines)


def crossover_n(times: dict[int, dict], mode: str, index: int) -> str:
    """The smallest N from which MHLA takes at most FlashAttention's time at every larger N measured
    (``index`` 0: eager, 1: CUDA graph); "none" if it never does, "–" without numbers."""
    sizes = sorted(times)
    ratio = {n: times[n]["mhla_op", mode][index] / times[n]["sdpa", mode][index] for n in sizes}
    if any(math.isnan(r) for r in ratio.values()):
        return "–"
    from_n = "none"
    for n in reversed(sizes):
        if ratio[n] > 1:
            break
        from_n = str(n)
    return from_n


def run_cuda_graphs(args, device, dtype) -> str:
    """The ``--cuda-graphs`` tables as text: host vs GPU per case, then the small-N crossover."""
    parts = []
    cases = graph_cases(args)
    if cases:
        times = {}
        for case, shape in cases.items():
            times[case] = (shape, eager_and_graph_ms(shape, GRAPH_METHODS, device, dtype, args.repeats))
            print(f"timed {case}", file=sys.stderr, flush=True)
        parts.append("host vs GPU: ms per call, eager (back-to-back calls: the host's or the GPU's time, "
                     "whichever is longer) and replayed from a CUDA graph (the GPU's time alone); MHLA in "
                     f"4x4 blocks on the square grids\n\n{host_vs_gpu_markdown(times)}")
    if args.crossover_sizes:
        b, h, d = args.graph_shape
        crossover = {}
        for n in args.crossover_sizes:
            side = square_side(n)
            shape = ModelShape(b, h, d, (side, side), GRAPH_BLOCKS)
            crossover[n] = eager_and_graph_ms(shape, ("sdpa", "mhla_op"), device, dtype, args.repeats)
            print(f"timed crossover N={n}", file=sys.stderr, flush=True)
        parts.append(f"small-N crossover: MHLA (4x4 blocks) against FlashAttention, B={b}, {h} heads x {d}, "
                     f"ms per call\n\n{crossover_markdown(crossover)}")
    return "\n\n".join(parts)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with the device-dependent defaults of ``--sizes`` and ``--shapes`` filled in."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sizes", type=int, nargs="*", default=None,
                        help="square-grid table sizes (default: 1024 4096 16384 on CPU, none on CUDA)")
    parser.add_argument("--shapes", nargs="*", choices=sorted(MODEL_SHAPES), default=None,
                        help="model-shape tables (default: all on CUDA, none on CPU)")
    parser.add_argument("--grids", type=parse_grid_case, nargs="*", default=[],
                        help="grid tables: GRID:BLOCKS cases timed side by side, e.g. the Wan 480p grid "
                             "21x30x52:3x5x10 against the even 21x30x50:3x5x10 (ms, MiB)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--skip-sdpa-above", type=int, default=4096,
                        help="above this N, time SDPA forward only (its fwd+bwd is huge on CPU)")
    parser.add_argument("--no-sdpa", action="store_true", help="leave SDPA out entirely")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="host vs GPU: eager times beside CUDA-graph replays (FlashAttention, LA, MHLA) "
                             "at --shapes and square --graph-sizes, then the small-N crossover at "
                             "--crossover-sizes (instead of the model-shape tables)")
    parser.add_argument("--graph-sizes", type=int, nargs="*", default=[256, 1024, 4096, 16384],
                        help="--cuda-graphs: square grids (tokens) in 4x4 blocks")
    parser.add_argument("--crossover-sizes", type=int, nargs="*",
                        default=[64, 144, 256, 576, 1024, 2304, 4096],
                        help="--cuda-graphs: the small-N crossover's square grids (tokens)")
    parser.add_argument("--graph-shape", type=int, nargs=3, default=[2, 16, 72],
                        metavar=("B", "HEADS", "DIM"),
                        help="--cuda-graphs: batch, heads, head dim of the square grids (default DiT-XL/2's)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", type=expand_path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--overwrite", action="store_true", help="replace --out even if this script did "
                        "not write it")
    args = parser.parse_args(argv)
    try:
        cuda = device_setting(args.device).type == "cuda"
    except ConfigError as error:
        parser.error(str(error))
    for n in args.graph_sizes + args.crossover_sizes:
        if math.isqrt(n) ** 2 != n or n < 16:
            parser.error(f"--graph-sizes and --crossover-sizes take square numbers >= 16 (a grid in 4x4 "
                         f"blocks), got {n}")
    if min(args.graph_shape) < 1:
        parser.error(f"--graph-shape takes three positive numbers, got {args.graph_shape}")
    if args.sizes is None:
        args.sizes = [] if cuda or args.grids or args.cuda_graphs else [1024, 4096, 16384]
    if args.shapes is None:
        args.shapes = sorted(MODEL_SHAPES) if cuda else []
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.out is not None:  # before hours of timing (outputs.folders); the checked path is the written one
        args.out = check_file_target(args.out, "--out", BENCH_KIND, args.overwrite)
    with writing_files((args.out, "--out")):  # one writer per file (a second one stops, naming this pid)
        bench(args)


def bench(args) -> None:
    """Time and measure what ``args`` asks for, print the tables and write ``args.out`` (if given)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for n in args.sizes:  # all timings first, under the default allocator
        rows += time_size(n, args, device, dtype)
        print(f"timed N={n}", file=sys.stderr)
    if not rows:
        memory = {}
    elif device.type == "cpu":  # a fresh process, so glibc can be configured before its heap grows
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            memory = pool.apply(measure_memory, (args,))
    else:
        memory = measure_memory(args)
    for row in rows:
        mem = memory[row["N"]]
        row.update(peak_mib_sdpa=mem.get("sdpa", math.nan), peak_mib_la=mem["la"],
                   peak_mib_mhla=mem[f"mhla{row['M']}"])

    setup = (f"device={args.device} dtype={args.dtype} B={args.batch} heads={args.heads} d={args.dim} "
             f"threads={torch.get_num_threads()} repeats={args.repeats} torch={torch.__version__}")
    print(setup)
    if rows:
        print("times in ms (median), peak memory in MiB (fwd+bwd), ratios: median of paired ratios\n")
        print(markdown(rows))
    if args.grids:
        times = time_grids(args, device, dtype)
        if device.type == "cpu":
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                grid_memory = pool.apply(measure_grid_memory, (args,))
        else:
            grid_memory = measure_grid_memory(args)
        print("\ngrids: times in ms (median), peak memory in MiB (fwd+bwd), ratios: medians of paired ratios")
        print("(per token vs first: this case's MHLA time per token over the first case's)\n")
        print(grids_markdown(args, times, grid_memory))
    model_rows = []
    if args.cuda_graphs:
        print(f"\n{run_cuda_graphs(args, device, dtype)}")
    elif args.shapes:
        text, model_rows = run_model_shapes(args, device, dtype)
        print(f"\n{text}")
    if args.out:
        report = {"setup": setup, "rows": rows, "model_rows": model_rows, **file_record(BENCH_KIND)}
        atomic_write_text(args.out, json.dumps(report, indent=2))


if __name__ == "__main__":
    run_cli(main)
