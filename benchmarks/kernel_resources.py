"""Registers, spills and shared memory of the Triton MHLA kernels, compiled for a GPU without one.

    python benchmarks/kernel_resources.py                    # sm_90 (H100 / H200), bf16, the model shapes
    python benchmarks/kernel_resources.py --arch 80 --dtype fp16 --shapes dit256

Each kernel is compiled (``triton.compile`` for a ``GPUTarget``; nothing is launched, no GPU is needed) with
the launch parameters the backend picks for the shape without a tile table, and Triton's bundled ``ptxas
-v`` reads the PTX: registers a thread (a multiprocessor holds 65,536, so they bound how many programs it
runs at once), bytes a thread spilled to local memory, and shared memory a program needs (227 KB at most on
an H100 / H200). The numbers are the compiler's, not timings; they depend on the Triton version, which the
table's first line names. Dense shapes compile the dense kernels (``ops/triton_dense.py``: the forward, the
query kernel with and without ∂W, the key kernel), blocked shapes the mixing kernel
(``ops/triton_mixing.py``) on their states.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from typing import NamedTuple

from mhla_gen.commands.cli import run as run_cli
from mhla_gen.errors import ConfigError


class Shape(NamedTuple):
    batch_heads: int
    dim: int
    grid: tuple[int, ...]
    blocks: tuple[int, ...]
    path: str  # "dense" or "blocked"


SHAPES = {
    "dit256": Shape(32, 72, (16, 16), (4, 4), "dense"),  # DiT-XL/2, 256 px
    "sana1024": Shape(140, 32, (32, 32), (4, 4), "dense"),  # SANA-1.6B at 1024 px, the dense path forced
    "uneven3d": Shape(6, 64, (7, 9, 5), (2, 4, 3), "dense"),  # the gpu test's uneven 3D grid
    "wan480": Shape(24, 128, (21, 30, 52), (3, 5, 10), "blocked"),  # Wan2.1-1.3B, 480p
    "sana4096": Shape(140, 32, (128, 128), (4, 4), "blocked"),  # SANA-1.6B, 4096 px
}
DTYPES = ("bf16", "fp16", "fp32")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    args = parser.parse_args(argv)
    if args.arch < 80:
        raise ConfigError(f"--arch={args.arch}: the kernels need compute capability 8.0 or later (80)")
    return args


def compile_kernel(kernel, pointers: dict[str, str], constants: dict, arch: int, num_warps: int,
                   num_stages: int | None):
    """``triton.compile`` of ``kernel`` for ``cuda:arch``: ``pointers`` name -> element type ("bf16", "fp32",
    "i32"), ``constants`` the constexprs; other arguments are i32 (``eps`` fp32)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = f"*{pointers[name]}"
        else:
            signature[name] = "fp32" if name == "eps" else "i32"
    options = {"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages})}
    source = ASTSource(kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def resources(compiled, arch: int) -> tuple[int, int, int]:
    """``(registers, spill bytes, shared bytes)`` of a compiled kernel, from ``ptxas -v`` on its PTX."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as file:
            file.write(compiled.asm["ptx"])
        suffix = "a" if arch == 90 else ""
        info = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", path, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    return registers, spills, compiled.metadata.shared


def dense_kernels(shape: Shape, dtype: str):
    """``(name, kernel, pointers, constants, num_warps, num_stages)`` of the dense path at ``shape``."""
    import triton.language as tl

    from mhla_gen import BlockLayout
    from mhla_gen.ops import triton_dense as td

    dot = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype]
    tiles, width = td.dense_tiles(shape.dim, shape.dim), td._pow2(shape.dim)
    layout = BlockLayout(shape.grid, shape.blocks)
    common = dict(FEATURE=0, NORMALIZE=True, DOT_DTYPE=dot, PRECISION="ieee", SCALE=dtype == "fp16",
                  EVEN=width == shape.dim, WIDE=False, BQ=tiles.block_q, BK=tiles.block_k, BD=width, BE=width)
    fp32 = {name: "fp32" for name in ("w", "den", "gden", "dw")}
    io = {name: dtype for name in ("q", "k", "v", "g", "o", "out", "dq", "dk", "dv")}
    pointers = {**io, **fp32, "blocks": "i32"}
    dq = dict(common, STORE_GDEN=True, COMPUTE_DQ=True, ONEHOT_K=False, ONEHOT_Q=False,
              BM=td._pow2(layout.num_blocks), SPAN=td.key_tile_span(shape.grid, shape.blocks, tiles.block_k))
    launch = (tiles.num_warps, tiles.num_stages)
    return [("dense forward", td._dense_fwd_kernel, pointers, dict(common, CLIP_FP16=False), *launch),
            ("dense dq", td._dense_dq_kernel, pointers, dict(dq, COMPUTE_DW=False), *launch),
            ("dense dq + dW", td._dense_dq_kernel, pointers, dict(dq, COMPUTE_DW=True), *launch),
            ("dense dk, dv", td._dense_dkv_kernel, pointers, dict(common, COMPUTE_DK=True, COMPUTE_DV=True),
             *launch)]


def mixing_kernels(shape: Shape, dtype: str):
    """The mixing kernel on the shape's states (bf16 for bf16 inputs, else fp32), default tiles."""
    from mhla_gen import BlockLayout
    from mhla_gen.ops import triton_mixing

    m = BlockLayout(shape.grid, shape.blocks).num_blocks
    tiles = triton_mixing.mix_tiles(m)
    state = "bf16" if dtype == "bf16" else "fp32"
    pointers = {"w": "fp32", "x": state, "y": state, "xz": "fp32", "yz": "fp32"}
    constants = dict(HAS_Z=True, PRECISION="tf32", WIDE=False, BM=tiles.block_m, BK=tiles.block_k,
                     BC=tiles.block_c)
    return [(f"mixing {tiles.block_m}x{tiles.block_c}", triton_mixing._mix_kernel, pointers, constants,
             tiles.num_warps, tiles.num_stages)]


def main(argv=None) -> None:
    args = parse_args(argv)
    import triton

    print(f"triton {triton.__version__}, sm_{args.arch}, {args.dtype}; per thread: registers, spilled bytes; "
          "per program: shared memory\n")
    print("| shape | kernel | warps | registers | spilled bytes | shared KB |\n|---|---|---:|---:|---:|---:|")
    for name in args.shapes:
        shape = SHAPES[name]
        kernels = (dense_kernels if shape.path == "dense" else mixing_kernels)(shape, args.dtype)
        for label, kernel, pointers, constants, warps, stages in kernels:
            compiled = compile_kernel(kernel, pointers, constants, args.arch, warps, stages)
            registers, spills, shared = resources(compiled, args.arch)
            row = f"| {name} | {label} | {warps} | {registers} | {spills} | {shared / 1024:.0f} |"
            print(row, flush=True)


if __name__ == "__main__":
    run_cli(main)
