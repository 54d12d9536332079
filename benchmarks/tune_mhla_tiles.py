"""Choose the Triton MHLA kernels' launch parameters offline, per GPU, and write them into the tile table.

    python benchmarks/tune_mhla_tiles.py           # CUDA, bf16, Wan 480p, SANA 4096 px, DiT 256 px (dense)
    python benchmarks/tune_mhla_tiles.py --list    # the candidates and table keys; nothing runs
    TRITON_INTERPRET=1 python benchmarks/tune_mhla_tiles.py --device cpu --shapes tiny --out /tmp/tiles.json

For each model shape: the blocked PyTorch backend's forward + backward is the reference; each candidate
``TileConfig`` (the heuristic first, then a few changes of it) runs the Triton forward + backward once and
must match the reference (output and every gradient within a few units of the dtype's roundoff: a broken
configuration is off by O(1); one that fails to launch, e.g. out of shared memory, is rejected); then its
forward + backward is timed (CUDA events, median of ``--repeats``). The fastest passing candidate is
written into the table under this device's name and the shape's class (``mhla_gen.ops.tile_table``),
which the kernels read from then on. ``--budget-s`` bounds the sweep: candidates that would start after it
are skipped (the heuristic is always timed).

Blocked shapes (``triton_mhla``) vary the token-loop kernels' tile, warps and pipeline depth (the summary,
output, dq and dk/dv kernels share them) and the mixing kernel's tiles, warps and depth; dense shapes
(``triton_dense``, for N up to its crossover) vary its tile, warps and depth, under the dense class
``dense-d…-e…-dtype-N…``.

The table (``--out``, default the package's ``mhla_gen/ops/mhla_tiles.json``) is checked before any work:
an existing file is updated only if this script wrote it (it carries the record ``mhla_tile_table``) or
with ``--overwrite``, and is replaced atomically; entries of other devices and shape classes are kept.

On CPU (``--device cpu``, only under ``TRITON_INTERPRET=1``) the kernels run in Triton's interpreter and
are timed with the wall clock: that checks the plumbing, not speed (``tests/test_tune_mhla_tiles.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import time
from typing import NamedTuple

import torch

from mhla_gen import BlockLayout, locality_init
from mhla_gen.commands.cli import device_setting, expand_path
from mhla_gen.commands.cli import run as run_cli
from mhla_gen.errors import ConfigError
from mhla_gen.ops import blocked, tile_table
from mhla_gen.outputs.folders import check_file_target
from mhla_gen.outputs.locks import writing_files
from mhla_gen.train.io import atomic_write_text

EPS = 1e-6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


class Shape(NamedTuple):
    batch: int
    heads: int
    dim: int
    grid: tuple[int, ...]
    blocks: tuple[int, ...]
    path: str = "blocked"  # the Triton path tuned: "blocked" (triton_mhla) or "dense" (triton_dense)


SHAPES = {
    "wan480": Shape(2, 12, 128, (21, 30, 52), (3, 5, 10)),  # Wan2.1-1.3B, 480p: 32,760 tokens, M = 150
    "sana4096": Shape(2, 70, 32, (128, 128), (4, 4)),  # SANA-1.6B, 4096 px: 16,384 tokens, M = 16
    "dit256": Shape(2, 16, 72, (16, 16), (4, 4), "dense"),  # DiT-XL/2, 256 px: 256 tokens, M = 16
    "tiny": Shape(1, 1, 16, (4, 6), (2, 2)),  # plumbing (interpreter)
    "tinydense": Shape(1, 1, 16, (4, 6), (2, 2), "dense"),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES),
                        default=["wan480", "sana4096", "dit256"])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--max-candidates", type=int, default=12,
                        help="candidates per shape, heuristic first")
    parser.add_argument("--repeats", type=int, default=10, help="timed forward + backward calls each")
    parser.add_argument("--budget-s", type=float, default=90.0, help="no candidate starts after this many "
                        "seconds of sweeping (split evenly over the shapes; the heuristic always runs)")
    parser.add_argument("--out", type=expand_path, default=str(tile_table.TABLE_PATH),
                        help="the tile table to update (default: the package's)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out even if this script did not "
                        "write it")
    parser.add_argument("--list", action="store_true", help="print candidates and table keys; run nothing")
    args = parser.parse_args(argv)
    for name in ("max_candidates", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be at least 1")
    if args.budget_s <= 0:
        raise ConfigError(f"--budget-s={args.budget_s}: must be positive")
    if args.list:
        return args
    device_setting(args.device, hint="the CPU plumbing run is --device cpu under TRITON_INTERPRET=1")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    return args


# --------------------------------------------------------------------------------------------------
# candidates


def heuristic(shape: Shape, device: torch.device):
    """The launch parameters the shape's path picks without a table: ``triton_mhla.tile_config``'s for the
    blocked path; for the dense path ``triton_dense.dense_tiles``' as a ``TileConfig``."""
    from mhla_gen.ops import triton_dense, triton_mhla

    geometry = triton_mhla._Geometry.of(shape.grid, shape.blocks)
    if shape.path == "dense":
        tiles = triton_dense.dense_tiles(shape.dim, shape.dim)
        return triton_mhla.TileConfig(block_t=tiles.block_q, num_warps=tiles.num_warps,
                                      num_stages=tiles.num_stages)
    return triton_mhla.tile_config(shape.dim, shape.dim, geometry.num_blocks, shape.batch * shape.heads,
                                   geometry.max_block_len, device)


def _changes(shape: Shape, base) -> list[dict]:
    """Changes of the heuristic ``base`` to try, most promising first (within each kernel family: longer
    loops per tile, then deeper or shallower pipelines, then the other warp count)."""
    from mhla_gen.ops import triton_mixing

    other_warps = 4 if base.num_warps == 8 else 8
    tokens = [{"block_t": base.block_t * 2}, {"num_stages": 4}, {"num_stages": 2},
              {"num_warps": other_warps}, {"block_t": base.block_t // 2}]
    if shape.path == "dense":
        return [*tokens, {"block_t": base.block_t // 2, "num_warps": 4}]
    m = num_blocks(shape)
    mix = triton_mixing.mix_tiles(m)
    rows = mix.block_m  # min(64, next power of two of M)
    tried, mixing = [mix], []
    for change in [  # the mixing kernel's tiles (defaults: triton_mixing.mix_tiles)
        {"mix_block_c": max(64, min(256, 8192 // rows)), "mix_num_warps": 4},  # the tiles before 2026-11-28
        {"mix_block_m": max(16, rows // 2), "mix_block_c": 64, "mix_num_warps": 8},  # more programs
        {"mix_block_c": 256, "mix_num_warps": 8},  # W read less often
        {"mix_num_stages": 2}, {"mix_num_stages": 4},
        {"mix_block_m": 256, "mix_block_c": 64, "mix_num_warps": 8},  # up to 256 blocks in one row tile
    ]:
        tiles = triton_mixing.mix_tiles(m, **{_MIX_ARGS[name]: value for name, value in change.items()})
        if tiles not in tried:  # not the default, nor another candidate under other numbers
            tried.append(tiles)
            mixing.append(change)
    interleaved = [c for pair in zip(tokens, mixing) for c in pair]
    return interleaved + tokens[len(mixing):] + mixing[len(tokens):] + [{"block_t": base.block_t * 4}]


_MIX_ARGS = {"mix_block_m": "block_m", "mix_block_c": "block_c", "mix_num_warps": "num_warps",
             "mix_num_stages": "num_stages"}  # TileConfig field -> triton_mixing.mix_tiles argument


def num_blocks(shape: Shape) -> int:
    """M of the shape's layout."""
    return BlockLayout(shape.grid, shape.blocks).num_blocks


def candidates(shape: Shape, device: torch.device, limit: int) -> list:
    """The heuristic, then changes of its tunable fields (``tile_table.FIELDS``, :func:`_changes`), at most
    ``limit``."""
    base = heuristic(shape, device)
    found = [base]
    for change in _changes(shape, base):
        try:
            tile_table.check_config(change, "candidate")
        except ValueError:
            continue  # outside the table's allowed values (a 16-token tile halved)
        config = dataclasses.replace(base, **change)
        if config not in found:
            found.append(config)
    return found[:limit]


def tuned_fields(config, shape: Shape | None = None) -> dict[str, int]:
    """The table's fields of ``config`` (those set; for a dense shape only those the dense path reads)."""
    names = DENSE_FIELDS if shape is not None and shape.path == "dense" else tile_table.FIELDS
    return {name: getattr(config, name) for name in names if getattr(config, name) is not None}


DENSE_FIELDS = ("block_t", "num_warps", "num_stages")  # what triton_dense.dense_tiles reads


def table_key(shape: Shape, dtype: torch.dtype) -> str:
    from mhla_gen.ops import triton_mhla

    geometry = triton_mhla._Geometry.of(shape.grid, shape.blocks)
    if shape.path == "dense":
        return tile_table.dense_shape_class(shape.dim, shape.dim, dtype, geometry.num_tokens)
    return tile_table.shape_class(shape.dim, shape.dim, dtype, geometry.max_block_len)


# --------------------------------------------------------------------------------------------------
# reference, check, timing


def inputs(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """``(q, k, v, grad_out, mixing)``: heads-interleaved q, k, v and grad_out as the processors pass them,
    the locality-init mixing matrix in fp32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    layout = BlockLayout(shape.grid, shape.blocks)
    n = layout.num_tokens
    q, k, v, g = (torch.randn(shape.batch, n, shape.heads, shape.dim, generator=gen, device=device)
                  .to(dtype).transpose(1, 2) for _ in range(4))
    return q, k, v, g, locality_init(layout).to(device, torch.float32)


def forward_backward(module, shape: Shape, tensors, config=None):
    """``(out, dq, dk, dv, dmixing)`` of ``module`` (``blocked``, ``triton_mhla`` or ``triton_dense``)."""
    q, k, v, g, mixing = tensors
    args = (q, k, v, shape.grid, shape.blocks, mixing, "relu", True, EPS)
    kwargs = {} if config is None else {"config": config}
    out, *saved = module.forward(*args, **kwargs)
    grads = module.backward(g, *args, out, *saved, (True,) * 4, **kwargs)
    return (out, *grads)


def max_error(got, expected) -> float:
    """Largest ``max |got - ref| / max |ref|`` over the output and the gradients."""
    return max(((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
               for a, b in zip(got, expected))


def tolerance(dtype: torch.dtype) -> float:
    """Both paths round to ``dtype`` (16-bit) or sum in fp32: a few unit roundoffs apart; a wrong
    configuration is off by O(1)."""
    return 8 * UNIT_ROUNDOFF[dtype] if dtype != torch.float32 else 1e-4


def time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median ms of ``fn()`` over ``repeats`` calls after one untimed call: CUDA events on CUDA (the
    GPU's time per call), the wall clock on CPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------------
# the sweep


def tune_shape(name: str, args, device: torch.device, dtype: torch.dtype, deadline: float) -> dict | None:
    """Check and time the candidates of one shape; the table entry of the fastest that passed (or None)."""
    from mhla_gen.ops import triton_dense, triton_mhla

    shape = SHAPES[name]
    module = triton_dense if shape.path == "dense" else triton_mhla
    tensors = inputs(shape, device, dtype)
    expected = forward_backward(blocked, shape, tensors)
    rows, best, default_ms = [], None, None
    for index, config in enumerate(candidates(shape, device, args.max_candidates)):
        fields = tuned_fields(config, shape)
        if index > 0 and time.monotonic() > deadline:
            rows.append(f"| {name} | {fields} | – | skipped: --budget-s spent |")
            continue
        try:
            error = max_error(forward_backward(module, shape, tensors, config), expected)
        except Exception as failure:  # noqa: BLE001 - any failure to compile or launch rejects the candidate
            rows.append(f"| {name} | {fields} | – | rejected: {type(failure).__name__} |")
            continue
        if not error <= tolerance(dtype):
            rows.append(f"| {name} | {fields} | {error:.1e} | rejected: differs from PyTorch |")
            continue
        ms = time_ms(lambda c=config: forward_backward(module, shape, tensors, c), device, args.repeats)
        rows.append(f"| {name} | {fields} | {error:.1e} | {ms:.3f} ms |")
        if index == 0:
            default_ms = ms
        if best is None or ms < best[1]:
            best = (config, ms)
    print("\n".join(rows), flush=True)
    if best is None:
        return None
    config, ms = best
    return {"config": tuned_fields(config, shape), "ms": round(ms, 4),
            "default_ms": None if default_ms is None else round(default_ms, 4),
            "shape": f"{name} {shape}", "dtype": args.dtype, "measured": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": _triton_version()}


def _triton_version() -> str:
    import triton

    return triton.__version__


def list_candidates(args, dtype: torch.dtype) -> None:
    device = torch.device(args.device if args.device == "cuda" and torch.cuda.is_available() else "cpu")
    for name in args.shapes:
        print(f"{name}: table key {table_key(SHAPES[name], dtype)}")
        for config in candidates(SHAPES[name], device, args.max_candidates):
            print(f"  {tuned_fields(config, SHAPES[name])}")


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    if args.list:
        list_candidates(args, dtype)
        return
    args.out = check_file_target(args.out, "--out", tile_table.TABLE_KIND, args.overwrite)
    table = tile_table.empty_table()
    if args.out.exists() and not args.overwrite:
        try:  # ours (check_file_target): it must also read back, before any work
            table = tile_table.read_table(args.out)
        except ValueError as error:
            raise ConfigError(f"--out={str(args.out)!r}: {error}; --overwrite starts it afresh") from None
    with writing_files((args.out, "--out")):
        sweep(args, dtype, table)


def sweep(args, dtype: torch.dtype, table: dict) -> None:
    from mhla_gen.ops import triton_mhla

    device = torch.device(args.device)
    name = triton_mhla.device_name(device)
    print(f"device {name}, dtype {args.dtype}, torch {torch.__version__}, triton {_triton_version()}\n")
    print("| shape | tuned fields | max rel. error vs PyTorch | forward + backward |\n|---|---|---|---|")
    start, share = time.monotonic(), args.budget_s / len(args.shapes)
    for i, shape in enumerate(args.shapes):
        entry = tune_shape(shape, args, device, dtype, deadline=start + (i + 1) * share)
        if entry is None:
            print(f"{shape}: no candidate matched PyTorch; its table entry is kept", file=sys.stderr)
            continue
        config = entry.pop("config")
        table = tile_table.with_entry(table, name, table_key(SHAPES[shape], dtype), config, entry)
    atomic_write_text(args.out, tile_table.dumps(table))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    run_cli(main)
