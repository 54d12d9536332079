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
def _mix_tile(w, x, y, M, C, i0, c0, stride_wi, stride_wj,
              PRECISION: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
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
        b_x = tl.load(x + o_j[:, None].to(tl.int64) * C + o_c[None, :],
                      mask=m_j[:, None] & m_c[None, :], other=0.0).to(tl.float32)  # [BK, BC]
        acc += tl.dot(b_w, b_x, input_precision=PRECISION)
    p_y = y + o_i[:, None].to(tl.int64) * C + o_c[None, :]
    tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_i[:, None] & m_c[None, :])


@triton.jit
def _mix_kernel(w, x, y, xz, yz, M, C, CZ, stride_wi, stride_wj,
                HAS_Z: tl.constexpr, PRECISION: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """y = w x ``(M, C)`` and yz = w xz ``(M, CZ)`` in one launch.

    Grid (cdiv(M, BM), cdiv(C, BC) + cdiv(CZ, BC)): the row tiles of one column tile are neighbours
    (their x tile is read from L2 after the first); column tiles past x's are xz's.
    """
    i_m, i_c = tl.program_id(0), tl.program_id(1)
    n_c = tl.cdiv(C, BC)
    if i_c < n_c:
        _mix_tile(w, x, y, M, C, i_m * BM, i_c * BC, stride_wi, stride_wj, PRECISION, BM, BK, BC)
    elif HAS_Z:
        _mix_tile(w, xz, yz, M, CZ, i_m * BM, (i_c - n_c) * BC, stride_wi, stride_wj, PRECISION, BM, BK, BC)


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


def mix_tiles(m: int, block_c: int | None = None) -> tuple[int, int, int]:
    """``(BM, BK, BC)`` of :func:`mix` for M blocks: row tiles of up to 64 blocks, 32 blocks per dot
    step, and columns so that the fp32 accumulator is about 8192 values (64 registers a thread at 4 warps)."""
    bm, bk = min(64, _pow2(m)), min(32, _pow2(m))
    return bm, bk, block_c or max(64, min(256, 8192 // bm))


def mix(w: torch.Tensor, x: torch.Tensor, xz: torch.Tensor | None, dtype: torch.dtype, precision: str,
        block_c: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(w @ x, w @ xz)``: x ``(M, ...)`` with contiguous rows in any float dtype, the result like x in
    ``dtype``; xz ``(M, ...)`` contiguous (or None), the result in fp32. w ``(M, M)``, any strides and
    float dtype (``w.T`` mixes back). ``precision``: the fp32 dots' ``input_precision``."""
    _check_rows(x, xz)
    m = w.shape[0]
    c, cz = x[0].numel(), 0 if xz is None else xz[0].numel()
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    yz = None if xz is None else torch.empty(xz.shape, dtype=torch.float32, device=x.device)
    bm, bk, bc = mix_tiles(m, block_c)
    grid = (triton.cdiv(m, bm), triton.cdiv(c, bc) + triton.cdiv(cz, bc))
    launch(_mix_kernel, grid, w, x, y, x if xz is None else xz, y if yz is None else yz, m, c, cz,
           *w.stride(), HAS_Z=xz is not None, PRECISION=precision, BM=bm, BK=bk, BC=bc, num_warps=4)
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


__all__ = ["gram", "gram_split", "launch", "mix", "mix_tiles"]
