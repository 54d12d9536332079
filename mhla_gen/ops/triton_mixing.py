"""Triton kernels for the block mixing of the Triton MHLA backend (``triton_mhla.py``), on tensor cores.

States are block-major rows: ``x`` is ``(M, C)`` with contiguous rows, C = B·H·d·e for the summaries
S (or their gradients) and C = B·H·d for the normalisers z. Two operations:

    mix:   y = w x and yz = w xz     one launch: S̃ = W S, z̃ = W z; backward dS = Wᵀ dS̃, dz = Wᵀ dz̃
    gram:  g = a bᵀ + az bzᵀ         two launches: dW = Σ_{batch, heads} <dS̃_i, S_j> + <dz̃_i, z_j>

``mix`` reads ``x`` in any dtype and multiplies in fp32 (``w`` and ``x`` as fp32 dot operands, tf32 or
ieee as the caller says), writing ``y`` in the caller's storage dtype and ``yz`` in fp32. ``gram`` takes
bf16 states as bf16 dot operands (exact products) and fp32 ones as fp32 operands; it accumulates in fp32
and splits the long reduction (C) over programs whose partial sums a second launch adds in a fixed order
(deterministic, no atomics). ``checks.mix_blocks`` is the plain reference both are tested against.

Every launch of the Triton backend goes through :func:`launch` (the tests count launches per call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: the one place the Triton MHLA backend launches a kernel."""
    kernel[grid](*args, **kwargs)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs every tile dim >= 16


# --------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _row_offsets(o_r, o_c, C, WIDE: tl.constexpr):
    """Element offsets ``[len(o_r), len(o_c)]`` of rows ``o_r``, columns ``o_c`` of an (M, C) matrix with
    contiguous rows: int32 unless WIDE (the host checks whether M·C fits)."""
    if WIDE:
        o_r = o_r.to(tl.int64)
    return o_r[:, None] * C + o_c[None, :]


@triton.jit
def _mix_tile(w, x, y, M, C, i0, c0, stride_wi, stride_wj, PRECISION: tl.constexpr, WIDE: tl.constexpr,
              BM: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """y[i0:i0+BM, c0:c0+BC] = Σ_j w[i, j] x[j, c] (rows of length C)."""
    o_i = i0 + tl.arange(0, BM)
    o_c = c0 + tl.arange(0, BC)
    m_i, m_c = o_i < M, o_c < C
    acc = tl.zeros([BM, BC], dtype=tl.float32)
    for j0 in range(0, M, BK):
        o_j = j0 + tl.arange(0, BK)
        m_j = o_j < M
        b_w = tl.load(w + o_i[:, None] * stride_wi + o_j[None, :] * stride_wj,
                      mask=m_i[:, None] & m_j[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        b_x = tl.load(x + _row_offsets(o_j, o_c, C, WIDE),
                      mask=m_j[:, None] & m_c[None, :], other=0.0).to(tl.float32)  # [BK, BC]
        acc += tl.dot(b_w, b_x, input_precision=PRECISION)
    p_y = y + _row_offsets(o_i, o_c, C, WIDE)
    tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_i[:, None] & m_c[None, :])


@triton.jit
def _mix_kernel(w, x, y, xz, yz, M, C, CZ, stride_wi, stride_wj,
                HAS_Z: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """y = w x ``(M, C)`` and yz = w xz ``(M, CZ)`` in one launch.

    Grid (cdiv(M, BM), cdiv(C, BC) + cdiv(CZ, BC)): the row tiles of one column tile are neighbours
    (their x tile is read from L2 after the first); column tiles past x's are xz's.
    """
    i_m, i_c = tl.program_id(0), tl.program_id(1)
    n_c = tl.cdiv(C, BC)
    if i_c < n_c:
        _mix_tile(w, x, y, M, C, i_m * BM, i_c * BC, stride_wi, stride_wj, PRECISION, WIDE, BM, BK, BC)
    elif HAS_Z:
        _mix_tile(w, xz, yz, M, CZ, i_m * BM, (i_c - n_c) * BC, stride_wi, stride_wj, PRECISION, WIDE,
                  BM, BK, BC)


@triton.jit
def _gram_tile(a, b, M, C, k0, k1, i0, j0, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
               BI: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr):
    """Σ_{k0 <= c < k1} a[i, c] b[j, c] for rows i0.. of a and j0.. of b: fp32 ``[BI, BJ]``."""
    o_i = i0 + tl.arange(0, BI)
    o_j = j0 + tl.arange(0, BJ)
    m_i, m_j = o_i < M, o_j < M
    acc = tl.zeros([BI, BJ], dtype=tl.float32)
    for c0 in range(k0, k1, BK):
        o_c = c0 + tl.arange(0, BK)
        m_c = o_c < k1
        b_a = tl.load(a + o_i[:, None].to(tl.int64) * C + o_c[None, :], mask=m_i[:, None] & m_c[None, :],
                      other=0.0)  # [BI, BK]
        b_b = tl.load(b + o_j[:, None].to(tl.int64) * C + o_c[None, :], mask=m_j[:, None] & m_c[None, :],
                      other=0.0)  # [BJ, BK]
        acc += tl.dot(b_a.to(DOT_DTYPE), tl.trans(b_b.to(DOT_DTYPE)), input_precision=PRECISION)
    return acc


@triton.jit
def _gram_kernel(a, b, az, bz, part, M, C, CZ, CHUNK, NSPLIT,
                 DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                 BI: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr):
    """part[s] = a[:, chunk s] b[:, chunk s]ᵀ ``(M, M)`` fp32; splits s >= NSPLIT take chunks of az, bz.

    Grid (cdiv(M, BI), cdiv(M, BJ), NSPLIT + cdiv(CZ, CHUNK)); a chunk is CHUNK columns.
    """
    i_i, i_j, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if i_s < NSPLIT:
        k0 = i_s * CHUNK
        acc = _gram_tile(a, b, M, C, k0, tl.minimum(k0 + CHUNK, C), i_i * BI, i_j * BJ, DOT_DTYPE, PRECISION,
                         BI, BJ, BK)
    else:
        k0 = (i_s - NSPLIT) * CHUNK
        acc = _gram_tile(az, bz, M, CZ, k0, tl.minimum(k0 + CHUNK, CZ), i_i * BI, i_j * BJ, tl.float32,
                         PRECISION, BI, BJ, BK)
    o_i = i_i * BI + tl.arange(0, BI)
    o_j = i_j * BJ + tl.arange(0, BJ)
    p = part + i_s.to(tl.int64) * M * M + o_i[:, None] * M + o_j[None, :]
    tl.store(p, acc, mask=(o_i < M)[:, None] & (o_j < M)[None, :])


@triton.jit
def _sum_kernel(part, out, NPART, NUMEL, BLOCK: tl.constexpr):
    """out[x] = Σ_p part[p, x], p in order (deterministic), in out's dtype. Grid cdiv(NUMEL, BLOCK)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < NUMEL
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(0, NPART):
        acc += tl.load(part + p * NUMEL + o, mask=m, other=0.0)
    tl.store(out + o, acc.to(out.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------------------------------
# host side


def _check_rows(*states: torch.Tensor | None) -> None:
    """The kernels index ``(M, C)`` rows as ``row * C + column``: contiguous memory only."""
    for x in states:
        if x is not None and not x.is_contiguous():
            raise ValueError(f"block-major states must be contiguous, got shape {tuple(x.shape)}, "
                             f"strides {x.stride()}")


@dataclass(frozen=True)
class MixTiles:
    """Launch parameters of :func:`mix`: row tile (blocks), dot step (blocks), column tile, warps, pipeline
    depth of the dot-step loop (None: Triton's default)."""

    block_m: int
    block_k: int
    block_c: int
    num_warps: int
    num_stages: int | None = None


def mix_tiles(m: int, block_c: int | None = None, block_m: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None) -> MixTiles:
    """:class:`MixTiles` for M blocks, each field from its argument (a ``TileConfig``'s ``mix_*`` fields, from
    an override or the tile table; a row tile at most M's next power of two), else: row tiles of up to 64
    blocks, 32 blocks per dot step, columns so
    that the fp32 accumulator holds about 4096 values (64 columns at 64 rows, 256 at 16), 8 warps for row
    tiles of 64 and 4 below, Triton's pipeline depth.

    Why (2026-11-28, reasoned, not yet timed): at Wan 480p (M = 150, bf16 states, 24 batch·heads x 128 x
    128 columns) the mixing took 598 µs of a 1.26 ms forward on an H200, ~400 GB/s for ~236 MB: a pass
    bound by how many loads each multiprocessor keeps in flight, with five dot steps per program. Compiled
    for the H200 (triton 3.6, ``ptxas -v``, bf16 states with their fp32 normalisers;
    ``benchmarks/kernel_resources.py``), the tiles of before
    (64 x 128, 4 warps, int64 offsets) used 255 registers a thread and 72 KB of shared memory: two programs,
    8 warps, per multiprocessor. With int32 offsets (:func:`mix`) the same tiles need 208 registers, still
    two programs; 64 x 64 tiles at 8 warps need 118 (two programs, 16 warps: twice the loads in flight,
    for W tiles read twice as often, from L1: W is 90 KB). The directions that read W less use more
    registers: 64 x 256 at 8 warps 248 (one program), all 150 rows in one tile of 256 rows 216 at 64
    columns (and 1.9 KB of spills at 128). The tile sweep (``benchmarks/tune_mhla_tiles.py``) times these
    alternatives; the table it writes overrides this heuristic."""
    bm = min(_pow2(block_m), _pow2(m)) if block_m else min(64, _pow2(m))
    bc = block_c or max(64, min(256, 4096 // bm))
    return MixTiles(bm, min(32, _pow2(m)), bc, num_warps or (8 if bm >= 64 else 4), num_stages)


def _wide(m: int, c: int) -> bool:
    """Whether an (M, C) matrix has element offsets beyond int32 (the mixing kernel then uses int64)."""
    return m * c >= 2**31


def mix(w: torch.Tensor, x: torch.Tensor, xz: torch.Tensor | None, dtype: torch.dtype, precision: str,
        tiles: MixTiles | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(w @ x, w @ xz)``: x ``(M, ...)`` with contiguous rows in any float dtype, the result like x in
    ``dtype``; xz ``(M, ...)`` contiguous (or None), the result in fp32. w ``(M, M)``, any strides and
    float dtype (``w.T`` mixes back). ``precision``: the fp32 dots' ``input_precision``; ``tiles``:
    launch parameters (default :func:`mix_tiles`)."""
    _check_rows(x, xz)
    m = w.shape[0]
    c, cz = x[0].numel(), 0 if xz is None else xz[0].numel()
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    yz = None if xz is None else torch.empty(xz.shape, dtype=torch.float32, device=x.device)
    tiles = tiles or mix_tiles(m)
    bm, bc = tiles.block_m, tiles.block_c
    grid = (triton.cdiv(m, bm), triton.cdiv(c, bc) + triton.cdiv(cz, bc))
    stages = {} if tiles.num_stages is None else {"num_stages": tiles.num_stages}
    launch(_mix_kernel, grid, w, x, y, x if xz is None else xz, y if yz is None else yz, m, c, cz,
           *w.stride(), HAS_Z=xz is not None, PRECISION=precision, WIDE=_wide(m, max(c, cz)),
           BM=bm, BK=tiles.block_k, BC=bc, num_warps=tiles.num_warps, **stages)
    return y, yz


def gram_split(m: int, c: int, sms: int, bi: int = 64, bj: int = 128, bk: int = 64) -> int:
    """Programs along the reduction of :func:`gram`: about two waves of ``sms`` multiprocessors over the
    ``(M, M)`` tiles, at least 4 dot steps each."""
    tiles = triton.cdiv(m, min(bi, _pow2(m))) * triton.cdiv(m, min(bj, _pow2(m)))
    return max(1, min(triton.cdiv(c, 4 * bk), triton.cdiv(2 * sms, tiles)))


def gram(a: torch.Tensor, b: torch.Tensor, az: torch.Tensor | None, bz: torch.Tensor | None, precision: str,
         dtype: torch.dtype, split: int) -> torch.Tensor:
    """``a bᵀ + az bzᵀ`` ``(M, M)`` in ``dtype`` over the rows of a, b ``(M, ...)`` (contiguous rows, one
    dtype: bf16 or fp32) and az, bz (fp32, or None). ``precision``: input_precision of fp32 dots;
    ``split``: programs along a's columns (:func:`gram_split`); az's columns are cut into the same chunks."""
    _check_rows(a, b, az, bz)
    m, c = a.shape[0], a[0].numel()
    cz = 0 if az is None else az[0].numel()
    # fp32 tiles of 64 + 128 rows x 64 columns: 48 KB a stage, 3 stages in an H100/H200's 227 KB of shared
    # memory (BJ = 256 needed 240 KB and could not launch)
    bi, bj, bk = min(64, _pow2(m)), min(128, _pow2(m)), 64
    chunk = triton.cdiv(triton.cdiv(c, split), bk) * bk
    nsplit = triton.cdiv(c, chunk)
    nparts = nsplit + triton.cdiv(cz, chunk)
    part = torch.empty(nparts, m, m, dtype=torch.float32, device=a.device)
    dot_dtype = tl.bfloat16 if a.dtype == torch.bfloat16 else tl.float32
    launch(_gram_kernel, (triton.cdiv(m, bi), triton.cdiv(m, bj), nparts),
           a, b, a if az is None else az, b if bz is None else bz, part, m, c, cz, chunk, nsplit,
           DOT_DTYPE=dot_dtype, PRECISION=precision,
           BI=bi, BJ=bj, BK=bk, num_warps=8 if bi * bj > 8192 else 4)
    out = torch.empty(m, m, dtype=dtype, device=a.device)
    launch(_sum_kernel, (triton.cdiv(m * m, 1024),), part, out, nparts, m * m, BLOCK=1024, num_warps=4)
    return out


__all__ = ["MixTiles", "gram", "gram_split", "launch", "mix", "mix_tiles"]
