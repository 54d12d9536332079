"""The Triton backend's dense path: MHLA as attention without softmax, for small token counts.

MHLA is attention with weights ``A[t, s] = W[b(t), b(s)] · φ(q_t)·φ(k_s)`` (``b(t)`` the block of token t,
``W`` the ``M x M`` mixing matrix, φ the feature map)::

    o_t = Σ_s A[t, s] v_s / den_t      den_t = Σ_s A[t, s] + eps      (normalize=False: o_t = Σ_s A[t, s] v_s)

Where N is small the blocked kernels (``triton_mhla.py``: summaries, mixing, output; three launches
forward, up to six backward) spend their time in passes and launches, not in arithmetic. Here the same
function is one kernel in the FlashAttention pattern, without the softmax and so without any running
maximum: a program owns a tile of queries of one (batch, head) and loops over all key tiles, ``P = φ(Q)
φ(K)ᵀ``, ``A = P ∘ W[b(t), b(s)]`` (gathered from the ``M x M`` table), ``acc += A V``, ``rowsum += Σ_s A``.
Exact, not an approximation: it costs ``O(N² d)`` against the blocked path's ``O(N d²)``, which wins only
where N is small (:func:`uses_dense_path` decides).

Backward, two launches (``G`` the output gradient, ``g_num_t = G_t / den_t``,
``g_den_t = -(G_t·o_t) / den_t``; without normalisation ``g_num = G`` and there is no ``g_den``)::

    dA[t, s] = g_num_t·v_s + g_den_t   dP = W[b(t), b(s)] ∘ dA
    dφ(q) = dP φ(K)   dW[i, j] = Σ_{b, h} Σ_{t∈i, s∈j} dA[t, s] P[t, s]   (kernel 1, per query tile;
                                                                          also writes g_den)
    dv = Aᵀ g_num     dφ(k) = dPᵀ φ(Q)                                    (kernel 2, per key tile)

dq = φ'(q) ∘ dφ(q), dk likewise. ∂W comes from per-program ``M x M`` partials (one-hot block matrices and
``tl.dot``), summed on the host with ``torch.sum``: no atomics, so results are identical run to run.

Block ids come from token ids arithmetically (:func:`_token_blocks`, the inverse of ``_block_box``): the
kernels read q, k, v in token order, tiles cross block boundaries freely, and uneven grids cost nothing.

Precision, as in ``triton_mhla.py``: accumulators, row sums, ``den`` and ``g_den`` are fp32; dot operands
are the input dtype (φ(q), φ(k), v, G exactly as loaded, and the fp32 tiles A, dP and dA ∘ P cast to it;
for fp16 those three are first scaled by a power of two so that their largest entry is about 2^14, as
``_dot_operand`` does for the states); fp32 inputs use TF32 iff
``torch.backends.cuda.matmul.allow_tf32``. Normalisers (Σ_s A, G·o) are fp32 vector reductions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_mhla import (
    _DOT_DTYPES,
    FEATURE_IDS,
    TileConfig,
    _check,
    _dot_operand,
    _dphi,
    _Geometry,
    _phi,
    _pow2,
    _precision,
    _ptr,
    _strides,
    heads_interleaved_empty,
)

# The crossover (defaults; a per-GPU tuning table passes its own through uses_dense_path's arguments):
# the dense path runs for at most DENSE_MAX_TOKENS tokens, DENSE_MAX_BLOCKS blocks and head dim
# DENSE_MAX_HEAD_DIM. DENSE_BLOCK_LIMIT is a hard limit, also for a forced dense path: each program of
# the dW pass keeps a (next power of two of M)² fp32 tile.
DENSE_MAX_TOKENS = 1024
DENSE_MAX_BLOCKS = 64
DENSE_MAX_HEAD_DIM = 128
DENSE_BLOCK_LIMIT = 128
PATHS = ("auto", "dense", "blocked")

_forced_path = "auto"  # set by triton_path(); read by uses_dense_path


# --------------------------------------------------------------------------------------------------
# the choice between the dense and the blocked path


def uses_dense_path(num_tokens: int, num_blocks: int, head_dim: int, override: bool | None = None, *,
                    max_tokens: int = DENSE_MAX_TOKENS, max_blocks: int = DENSE_MAX_BLOCKS) -> bool:
    """Whether the Triton backend's forward runs the dense path for these static shapes.

    ``override`` (True / False) decides outright; None: the path forced by :func:`triton_path`, else the
    crossover ``num_tokens <= max_tokens and num_blocks <= max_blocks and head_dim <= DENSE_MAX_HEAD_DIM``
    (``num_blocks <= DENSE_BLOCK_LIMIT`` whatever ``max_blocks`` says).
    Deterministic in its arguments (and the forced path): the op's fake implementation and its real one
    must agree, since the two paths save different tensors. Raises ValueError when the dense path is
    forced with more than ``DENSE_BLOCK_LIMIT`` blocks.
    """
    choice = override
    if choice is None and _forced_path != "auto":
        choice = _forced_path == "dense"
    if choice is None:
        blocks_fit = num_blocks <= min(max_blocks, DENSE_BLOCK_LIMIT)
        return num_tokens <= max_tokens and blocks_fit and head_dim <= DENSE_MAX_HEAD_DIM
    if choice and num_blocks > DENSE_BLOCK_LIMIT:
        raise ValueError(f"the dense MHLA path takes at most {DENSE_BLOCK_LIMIT} blocks, got {num_blocks}")
    return bool(choice)


@contextlib.contextmanager
def triton_path(path: str):
    """Force the Triton backend's path inside the block: ``"dense"``, ``"blocked"`` or ``"auto"`` (the
    crossover of :func:`uses_dense_path`). For tests and benchmarks.

    Process-wide, read when a forward starts (the op's fake implementation reads it too, when a compiled
    graph is traced: enter the block around the compiled call, and do not change it between tracing and
    running). A backward always runs the path its forward ran (:func:`ran_dense`).
    """
    global _forced_path
    if path not in PATHS:
        raise ValueError(f"unknown Triton MHLA path {path!r}; choose one of {PATHS}")
    previous, _forced_path = _forced_path, path
    try:
        yield
    finally:
        _forced_path = previous


def ran_dense(state: torch.Tensor) -> bool:
    """Whether a forward's saved ``state`` comes from the dense path: it saves none (an empty tensor);
    the blocked path's ``S̃`` has ``B·H·M·d·e > 0`` entries."""
    return state.numel() == 0


@dataclass(frozen=True)
class DenseTiles:
    """Launch parameters of the dense kernels: query and key tile lengths and warps per program."""

    block_q: int
    block_k: int
    num_warps: int


def dense_tiles(d: int, e: int, override: TileConfig | None = None) -> DenseTiles:
    """Tiles of 64 tokens for head dims up to 64, else 32 (full d and e per program, like the blocked
    kernels); ``override.block_t`` sets both tile lengths (rounded up to a power of two >= 16, what
    ``tl.dot`` needs) and ``override.num_warps`` the warps. Heuristic, not measured yet."""
    override = override or TileConfig()
    wide = max(_pow2(d), _pow2(e)) > 64
    block = _pow2(override.block_t) if override.block_t else (32 if wide else 64)
    return DenseTiles(block, block, override.num_warps or (8 if wide else 4))


# --------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _axis_block(x, BASE, EXTRA):
    """Block of coordinate ``x`` along an axis whose first EXTRA blocks have BASE + 1 tokens (covering
    EXTRA·(BASE + 1) tokens) and the rest BASE (>= 1, since blocks <= grid)."""
    long_end = EXTRA * (BASE + 1)
    return tl.where(x < long_end, x // (BASE + 1), EXTRA + (x - long_end) // BASE)


@triton.jit
def _token_blocks(tok, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2):
    """Block ids ``b(t)`` of row-major token ids ``tok`` on the (G0, G1, G2) token grid.

    Token t sits at (t // (G1·G2), (t // G2) % G1, t % G2); its block ids per axis are row-major over the
    block grid (NB0, NB1, NB2). A token id >= N (tile padding) maps to a block id >= M.
    """
    b0 = _axis_block(tok // (G1 * G2), BASE0, EXTRA0)
    b1 = _axis_block((tok // G2) % G1, BASE1, EXTRA1)
    b2 = _axis_block(tok % G2, BASE2, EXTRA2)
    return (b0 * NB1 + b1) * NB2 + b2


@triton.jit
def _rows(base, tok, m_t, stride_n, o_c, m_c, stride_c):
    """Tile ``[len(tok), len(o_c)]`` of a (N, C) matrix at ``base`` (rows ``tok``, columns ``o_c``) in its
    own dtype; zero outside the masks."""
    ptrs = base + tok.to(tl.int64)[:, None] * stride_n + o_c[None, :] * stride_c
    return tl.load(ptrs, mask=m_t[:, None] & m_c[None, :], other=0.0)


@triton.jit
def _store_rows(base, tok, m_t, stride_n, o_c, m_c, stride_c, x):
    """Store the fp32 tile ``x`` ``[len(tok), len(o_c)]`` into rows ``tok`` of the (N, C) matrix at ``base``,
    in that matrix's dtype, inside the masks."""
    ptrs = base + tok.to(tl.int64)[:, None] * stride_n + o_c[None, :] * stride_c
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


@triton.jit
def _feature_rows(base, tok, m_t, stride_n, o_c, m_c, stride_c, FEATURE: tl.constexpr):
    """``(x, φ(x))`` fp32 tiles of q or k rows ``tok``; φ is zeroed outside the masks (φ(0) = 1 for elu+1)."""
    x = _rows(base, tok, m_t, stride_n, o_c, m_c, stride_c).to(tl.float32)
    return x, tl.where(m_t[:, None] & m_c[None, :], _phi(x, FEATURE), 0.0)


@triton.jit
def _mixing_tile(w, blk_q, m_q, blk_k, m_k, M):
    """``W[b(t), b(s)]`` fp32 ``[BQ, BK]`` gathered from the contiguous (M, M) table; 0 for padding."""
    return tl.load(w + blk_q[:, None] * M + blk_k[None, :], mask=m_q[:, None] & m_k[None, :], other=0.0)


@triton.jit
def _scaled_dot(a, b, DOT_DTYPE: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` in fp32 for an fp32 tile ``a`` (A, dP, dA ∘ P) cast to the dot dtype (scaled into fp16's
    range first where SCALE, see ``_dot_operand``); ``b`` already in the dot dtype."""
    a_op, c = _dot_operand(a, DOT_DTYPE, SCALE)
    return tl.dot(a_op, b, input_precision=PRECISION) * c


# --------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _dense_fwd_kernel(
    q, k, v, w, out, den,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_ob, stride_oh, stride_on, stride_oe,
    H, N, M, D, E, eps, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2,
    FEATURE: tl.constexpr, NORMALIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    SCALE: tl.constexpr, CLIP_FP16: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
):
    """o_t = Σ_s A[t, s] v_s / den_t for one tile of BQ query tokens of one (batch, head).

    Grid (cdiv(N, BQ), B*H). Writes ``den`` (B, H, N) contiguous fp32 (with the normaliser).
    """
    i_q, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    tok_q = i_q * BQ + tl.arange(0, BQ)  # [BQ] token ids, row-major on the grid
    m_q = tok_q < N
    blk_q = _token_blocks(tok_q, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2)
    _, b_fq = _feature_rows(q + i_b * stride_qb + i_h * stride_qh, tok_q, m_q, stride_qn, o_d, m_d,
                            stride_qd, FEATURE)
    b_fq = b_fq.to(DOT_DTYPE)  # φ(Q) [BQ, BD]
    k_base = k + i_b * stride_kb + i_h * stride_kh
    v_base = v + i_b * stride_vb + i_h * stride_vh

    acc = tl.zeros([BQ, BE], dtype=tl.float32)  # Σ_s A[t, s] v_s
    rowsum = tl.zeros([BQ], dtype=tl.float32)  # Σ_s A[t, s]
    for s0 in range(0, N, BK):
        tok_k = s0 + tl.arange(0, BK)
        m_k = tok_k < N
        blk_k = _token_blocks(tok_k, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2)
        _, b_fk = _feature_rows(k_base, tok_k, m_k, stride_kn, o_d, m_d, stride_kd, FEATURE)  # [BK, BD]
        b_v = _rows(v_base, tok_k, m_k, stride_vn, o_e, m_e, stride_ve).to(DOT_DTYPE)  # [BK, BE]
        b_p = tl.dot(b_fq, tl.trans(b_fk.to(DOT_DTYPE)), input_precision=PRECISION)  # P [BQ, BK]
        b_a = b_p * _mixing_tile(w, blk_q, m_q, blk_k, m_k, M)  # A = P ∘ W[b(t), b(s)]
        if NORMALIZE:
            rowsum += tl.sum(b_a, axis=1)
        acc += _scaled_dot(b_a, b_v, DOT_DTYPE, SCALE, PRECISION)

    if NORMALIZE:
        b_den = rowsum + eps
        acc = acc / b_den[:, None]
        tl.store(den + i_bh.to(tl.int64) * N + tok_q, b_den, mask=m_q)
    if CLIP_FP16:
        acc = tl.minimum(tl.maximum(acc, -65504.0), 65504.0)
    _store_rows(out + i_b * stride_ob + i_h * stride_oh, tok_q, m_q, stride_on, o_e, m_e, stride_oe, acc)


@triton.jit
def _query_prologue(g_base, o_base, den, gden, row0, tok_q, m_q, stride_gn, stride_ge, stride_on, stride_oe,
                    o_e, m_e, NORMALIZE: tl.constexpr, STORE_GDEN: tl.constexpr):
    """``(G, 1/den, g_den)`` of a query tile: G [BQ, BE] as loaded; fp32 [BQ] ``1/den_t`` and
    ``g_den_t = -(G_t·o_t)/den_t`` (1 and 0 without the normaliser). ``row0``: offset of this (batch,
    head) in the (B, H, N) buffers ``den`` and ``gden``; STORE_GDEN writes g_den there."""
    b_g = _rows(g_base, tok_q, m_q, stride_gn, o_e, m_e, stride_ge)
    b_rden = tl.full(tok_q.shape, 1.0, tl.float32)
    b_gden = tl.zeros(tok_q.shape, tl.float32)
    if NORMALIZE:
        b_rden = 1.0 / tl.load(den + row0 + tok_q, mask=m_q, other=1.0)
        b_o = _rows(o_base, tok_q, m_q, stride_on, o_e, m_e, stride_oe).to(tl.float32)
        b_gden = -tl.sum(b_g.to(tl.float32) * b_o, axis=1) * b_rden
        if STORE_GDEN:
            tl.store(gden + row0 + tok_q, b_gden, mask=m_q)
    return b_g, b_rden, b_gden


@triton.jit
def _dense_dq_kernel(
    q, k, v, w, g, o, den, gden, dq, dw,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_gb, stride_gh, stride_gn, stride_ge,
    stride_ob, stride_oh, stride_on, stride_oe,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    BH, H, N, M, D, E, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2,
    FEATURE: tl.constexpr, NORMALIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    SCALE: tl.constexpr, STORE_GDEN: tl.constexpr, COMPUTE_DQ: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr,
):
    """Backward over one query tile: g_den (for kernel 2), dq and this program's ∂W partial.

    Grid (cdiv(N, BQ), B*H). Per key tile, with dA[t, s] = (G_t·v_s)/den_t + g_den_t:
        dφ(q) += (W[b(t), b(s)] ∘ dA) φ(K)        Σ_{s∈j} dA[t, s] P[t, s] += (dA ∘ P) onehot(b(s))
    Writes ``gden`` (B, H, N) fp32 (STORE_GDEN) and ``dw`` (cdiv(N, BQ), B*H, M, M) fp32, program (i_q, bh)
    its own ``[M, M]`` slice: ``Σ_{t∈i, s∈j}`` over its query tokens t and all keys s.
    """
    i_q, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    o_d, o_e, o_m = tl.arange(0, BD), tl.arange(0, BE), tl.arange(0, BM)
    m_d, m_e = o_d < D, o_e < E
    tok_q = i_q * BQ + tl.arange(0, BQ)
    m_q = tok_q < N
    blk_q = _token_blocks(tok_q, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2)
    b_g, b_rden, b_gden = _query_prologue(
        g + i_b * stride_gb + i_h * stride_gh, o + i_b * stride_ob + i_h * stride_oh, den, gden,
        i_bh.to(tl.int64) * N, tok_q, m_q, stride_gn, stride_ge, stride_on, stride_oe, o_e, m_e,
        NORMALIZE, STORE_GDEN)
    if COMPUTE_DQ or COMPUTE_DW:
        b_q, b_fq = _feature_rows(q + i_b * stride_qb + i_h * stride_qh, tok_q, m_q, stride_qn, o_d, m_d,
                                  stride_qd, FEATURE)
        b_fq_op, b_g_op = b_fq.to(DOT_DTYPE), b_g.to(DOT_DTYPE)
        acc_dfq = tl.zeros([BQ, BD], dtype=tl.float32)  # dφ(q)
        acc_dw = tl.zeros([BQ, BM], dtype=tl.float32)  # [t, j]: Σ_{s∈j} dA[t, s] P[t, s]
        k_base = k + i_b * stride_kb + i_h * stride_kh
        v_base = v + i_b * stride_vb + i_h * stride_vh
        for s0 in range(0, N, BK):
            tok_k = s0 + tl.arange(0, BK)
            m_k = tok_k < N
            blk_k = _token_blocks(tok_k, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2)
            _, b_fk = _feature_rows(k_base, tok_k, m_k, stride_kn, o_d, m_d, stride_kd, FEATURE)
            b_fk = b_fk.to(DOT_DTYPE)  # [BK, BD]
            b_v = _rows(v_base, tok_k, m_k, stride_vn, o_e, m_e, stride_ve).to(DOT_DTYPE)  # [BK, BE]
            b_da = tl.dot(b_g_op, tl.trans(b_v), input_precision=PRECISION)  # G_t·v_s [BQ, BK]
            b_da = b_da * b_rden[:, None] + b_gden[:, None]  # dA
            if COMPUTE_DQ:
                b_dp = b_da * _mixing_tile(w, blk_q, m_q, blk_k, m_k, M)  # dP = W[b(t), b(s)] ∘ dA
                acc_dfq += _scaled_dot(b_dp, b_fk, DOT_DTYPE, SCALE, PRECISION)
            if COMPUTE_DW:
                b_p = tl.dot(b_fq_op, tl.trans(b_fk), input_precision=PRECISION)  # P [BQ, BK]
                onehot_k = ((blk_k[:, None] == o_m[None, :]) & m_k[:, None]).to(DOT_DTYPE)  # [BK, BM]
                acc_dw += _scaled_dot(b_da * b_p, onehot_k, DOT_DTYPE, SCALE, PRECISION)

        if COMPUTE_DQ:
            dq_base = dq + i_b * stride_dqb + i_h * stride_dqh
            _store_rows(dq_base, tok_q, m_q, stride_dqn, o_d, m_d, stride_dqd, acc_dfq * _dphi(b_q, FEATURE))
        if COMPUTE_DW:
            # [i, j] = Σ_t onehot(b(t))[t, i] acc_dw[t, j]: [BM, BQ] @ [BQ, BM] in fp32 (no operand rounding)
            onehot_q = ((blk_q[:, None] == o_m[None, :]) & m_q[:, None]).to(tl.float32)  # [BQ, BM]
            b_dw = tl.dot(tl.trans(onehot_q), acc_dw, input_precision="ieee")
            p_dw = dw + (i_q * BH + i_bh).to(tl.int64) * M * M + o_m[:, None] * M + o_m[None, :]
            tl.store(p_dw, b_dw, mask=(o_m[:, None] < M) & (o_m[None, :] < M))


@triton.jit
def _dense_dkv_kernel(
    q, k, v, w, g, den, gden, dk, dv,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_gb, stride_gh, stride_gn, stride_ge,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dve,
    H, N, M, D, E, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2,
    FEATURE: tl.constexpr, NORMALIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    SCALE: tl.constexpr, COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
):
    """Backward over one key tile: dv_s = Σ_t A[t, s] G_t / den_t and dφ(k_s) = Σ_t dP[t, s] φ(q_t).

    Grid (cdiv(N, BK), B*H); reads den and g_den (B, H, N) fp32 (the latter from kernel 1).
    """
    i_k, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    tok_k = i_k * BK + tl.arange(0, BK)
    m_k = tok_k < N
    blk_k = _token_blocks(tok_k, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2)
    b_k, b_fk = _feature_rows(k + i_b * stride_kb + i_h * stride_kh, tok_k, m_k, stride_kn, o_d, m_d,
                              stride_kd, FEATURE)
    b_fk_op = b_fk.to(DOT_DTYPE)  # [BK, BD]
    b_v = _rows(v + i_b * stride_vb + i_h * stride_vh, tok_k, m_k, stride_vn, o_e, m_e, stride_ve)
    b_v = b_v.to(DOT_DTYPE)  # [BK, BE]
    row0 = i_bh.to(tl.int64) * N  # this (batch, head) in den and gden
    q_base = q + i_b * stride_qb + i_h * stride_qh
    g_base = g + i_b * stride_gb + i_h * stride_gh

    acc_dfk = tl.zeros([BK, BD], dtype=tl.float32)
    acc_dv = tl.zeros([BK, BE], dtype=tl.float32)
    for t0 in range(0, N, BQ):
        tok_q = t0 + tl.arange(0, BQ)
        m_q = tok_q < N
        blk_q = _token_blocks(tok_q, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2)
        _, b_fq = _feature_rows(q_base, tok_q, m_q, stride_qn, o_d, m_d, stride_qd, FEATURE)
        b_fq = b_fq.to(DOT_DTYPE)  # [BQ, BD]
        b_g = _rows(g_base, tok_q, m_q, stride_gn, o_e, m_e, stride_ge).to(DOT_DTYPE)  # [BQ, BE]
        b_w = _mixing_tile(w, blk_q, m_q, blk_k, m_k, M)  # [BQ, BK]
        b_rden = tl.full([BQ], 1.0, tl.float32)
        if NORMALIZE:
            b_rden = 1.0 / tl.load(den + row0 + tok_q, mask=m_q, other=1.0)
        if COMPUTE_DV:
            b_p = tl.dot(b_fq, tl.trans(b_fk_op), input_precision=PRECISION)  # P [BQ, BK]
            b_an = b_p * b_w * b_rden[:, None]  # A[t, s] / den_t
            acc_dv += _scaled_dot(tl.trans(b_an), b_g, DOT_DTYPE, SCALE, PRECISION)  # [BK, BE]
        if COMPUTE_DK:
            b_da = tl.dot(b_g, tl.trans(b_v), input_precision=PRECISION) * b_rden[:, None]  # [BQ, BK]
            if NORMALIZE:
                b_da += tl.load(gden + row0 + tok_q, mask=m_q, other=0.0)[:, None]
            acc_dfk += _scaled_dot(tl.trans(b_da * b_w), b_fq, DOT_DTYPE, SCALE, PRECISION)  # [BK, BD]

    if COMPUTE_DK:
        _store_rows(dk + i_b * stride_dkb + i_h * stride_dkh, tok_k, m_k, stride_dkn, o_d, m_d, stride_dkd,
                    acc_dfk * _dphi(b_k, FEATURE))
    if COMPUTE_DV:
        _store_rows(dv + i_b * stride_dvb + i_h * stride_dvh, tok_k, m_k, stride_dvn, o_e, m_e, stride_dve,
                    acc_dv)


# --------------------------------------------------------------------------------------------------
# host side: the contract of triton_mhla.forward / backward (``mhla.py``), same arguments


def _constexprs(dtype: torch.dtype, feature_map: str, tiles: DenseTiles, d: int, e: int) -> dict:
    """Constexpr kwargs shared by the three kernels."""
    dot_dtype = _DOT_DTYPES[dtype]
    return dict(FEATURE=FEATURE_IDS[feature_map], DOT_DTYPE=dot_dtype, PRECISION=_precision(dtype),
                SCALE=dot_dtype == tl.float16, BQ=tiles.block_q, BK=tiles.block_k, BD=_pow2(d), BE=_pow2(e),
                num_warps=tiles.num_warps)


def _mixing_table(mixing: torch.Tensor) -> torch.Tensor:
    """W as the kernels gather it: (M, M) contiguous fp32 (no copy when it already is)."""
    return mixing.to(torch.float32).contiguous()


def forward_outputs_like(q: torch.Tensor, v: torch.Tensor, blocks: Sequence[int], normalize: bool):
    """Empty ``(out, state, norm, den)`` with the shapes, dtypes and strides :func:`forward` returns (the
    op's fake implementation on this path): state and norm empty."""
    b, h, n, e = v.shape
    den = q.new_empty(b, h, n, dtype=torch.float32) if normalize else q.new_empty(0, dtype=torch.float32)
    return (heads_interleaved_empty(b, h, n, e, q), q.new_empty(0, dtype=torch.float32),
            q.new_empty(0, dtype=torch.float32), den)


def forward(q, k, v, grid: Sequence[int], blocks: Sequence[int], mixing, feature_map: str, normalize: bool,
            eps: float, *, config: TileConfig | None = None):
    """Dense MHLA forward, one launch. Arguments and checks as ``triton_mhla.forward``.

    Returns ``(out, state, norm, den)`` (``mhla.Saved``): out ``(B, H, N, e)`` in q's dtype on
    heads-interleaved memory (fp16 clipped to ±65504); state and norm empty fp32 (the dense backward
    needs neither; an empty state marks a dense forward, :func:`ran_dense`); den ``(B, H, N)`` fp32
    contiguous, ``Σ_s A[t, s] + eps`` (empty without the normaliser).
    """
    geometry = _Geometry.of(grid, blocks)
    _check(q, k, v, mixing, geometry, feature_map)
    b, h, n, d = q.shape
    e = v.shape[-1]
    tiles = dense_tiles(d, e, config)
    out, state, norm, den = forward_outputs_like(q, v, blocks, normalize)
    _dense_fwd_kernel[(triton.cdiv(n, tiles.block_q), b * h)](
        q, k, v, _mixing_table(mixing), out, den if normalize else q,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        h, n, geometry.num_blocks, d, e, float(eps), *geometry.args(),
        NORMALIZE=normalize, CLIP_FP16=q.dtype == torch.float16,
        **_constexprs(q.dtype, feature_map, tiles, d, e),
    )
    return out, state, norm, den


def backward(grad_out, q, k, v, grid: Sequence[int], blocks: Sequence[int], mixing, feature_map: str,
             normalize: bool, eps: float, out, state, norm, den, needs: Sequence[bool], *,
             config: TileConfig | None = None):
    """Gradients ``(dq, dk, dv, dmixing)`` of :func:`forward`, None where ``needs[i]`` is False: at most two
    launches, kernel 1 (query tiles: g_den, dq, ∂W partials) then kernel 2 (key tiles: dk, dv).

    Arguments as ``triton_mhla.backward``; of the saved tensors only ``den`` is read (eps is in it). dq, dk,
    dv in the dtypes of q, k, v on heads-interleaved memory; dmixing ``(M, M)`` in mixing's dtype.
    """
    geometry = _Geometry.of(grid, blocks)
    _check(q, k, v, mixing, geometry, feature_map)
    need_q, need_k, need_v, need_w = (bool(x) for x in needs)
    b, h, n, d = q.shape
    tiles = dense_tiles(d, v.shape[-1], config)
    w = _mixing_table(mixing)
    # g_den (B, H, N) fp32, written by kernel 1 for kernel 2
    gden = q.new_empty(b, h, n, dtype=torch.float32) if normalize and (need_k or need_v) else None
    dq, dmixing = None, None
    if need_q or need_w or gden is not None:
        dq, dmixing = _query_pass(grad_out, q, k, v, geometry, w, feature_map, normalize, out, den, gden,
                                  need_q, need_w, tiles)
        dmixing = None if dmixing is None else dmixing.to(mixing.dtype)
    dk, dv = None, None
    if need_k or need_v:
        dk, dv = _key_pass(grad_out, q, k, v, geometry, w, feature_map, normalize, den, gden, need_k, need_v,
                           tiles)
    return dq, dk, dv, dmixing


def _query_pass(grad_out, q, k, v, geometry: _Geometry, w, feature_map: str, normalize: bool, out, den, gden,
                need_q: bool, need_w: bool, tiles: DenseTiles):
    """Kernel 1: ``(dq, dW)`` (None where not needed); writes ``gden`` when given. dW ``(M, M)`` fp32 is
    the sum of the programs' ``(M, M)`` partials over query tiles and batch·heads (``torch.sum``: a fixed
    reduction order, no atomics)."""
    b, h, n, d = q.shape
    e, m = v.shape[-1], geometry.num_blocks
    num_q_tiles = triton.cdiv(n, tiles.block_q)
    dq = heads_interleaved_empty(b, h, n, d, q) if need_q else None
    partials = q.new_empty(num_q_tiles, b * h, m, m, dtype=torch.float32) if need_w else None
    _dense_dq_kernel[(num_q_tiles, b * h)](
        q, k, v, w, grad_out, out, den if normalize else q, _ptr(gden, q), _ptr(dq, q), _ptr(partials, q),
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *out.stride(), *_strides(dq, 4),
        b * h, h, n, m, d, e, *geometry.args(),
        NORMALIZE=normalize, STORE_GDEN=gden is not None, COMPUTE_DQ=need_q, COMPUTE_DW=need_w,
        BM=_pow2(m), **_constexprs(q.dtype, feature_map, tiles, d, e),
    )
    return dq, None if partials is None else partials.sum(dim=(0, 1))


def _key_pass(grad_out, q, k, v, geometry: _Geometry, w, feature_map: str, normalize: bool, den, gden,
              need_k: bool, need_v: bool, tiles: DenseTiles):
    """Kernel 2: ``(dk, dv)`` (None where not needed), reading den and g_den (with the normaliser)."""
    b, h, n, d = k.shape
    e = v.shape[-1]
    dk = heads_interleaved_empty(b, h, n, d, k) if need_k else None
    dv = heads_interleaved_empty(b, h, n, e, v) if need_v else None
    _dense_dkv_kernel[(triton.cdiv(n, tiles.block_k), b * h)](
        q, k, v, w, grad_out, den if normalize else q, _ptr(gden, q), _ptr(dk, q), _ptr(dv, q),
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *_strides(dk, 4), *_strides(dv, 4),
        h, n, geometry.num_blocks, d, e, *geometry.args(),
        NORMALIZE=normalize, COMPUTE_DK=need_k, COMPUTE_DV=need_v,
        **_constexprs(q.dtype, feature_map, tiles, d, e),
    )
    return dk, dv


__all__ = [
    "DENSE_BLOCK_LIMIT",
    "DENSE_MAX_BLOCKS",
    "DENSE_MAX_HEAD_DIM",
    "DENSE_MAX_TOKENS",
    "DenseTiles",
    "backward",
    "dense_tiles",
    "forward",
    "forward_outputs_like",
    "ran_dense",
    "triton_path",
    "uses_dense_path",
]
