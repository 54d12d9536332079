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

dq = φ'(q) ∘ dφ(q), dk likewise. ∂W: each program of kernel 1 keeps ``acc[t, j] = Σ_{s∈j} dA[t, s] P[t, s]``
for its query tokens (fp32 ``[BQ, M]``): per key tile, one masked row sum (``tl.sum``) for each key block
the tile touches (a key tile of consecutive tokens touches few: 4 at DiT-XL/2 256 px), then per query
block of its tile one masked column sum into its own ``M x M`` slice of a zeroed buffer, which the host
adds up with ``torch.sum``. No atomics and no dots: the same numbers run to run, on any backend. Until
2026-11-28 both sums were ``tl.dot``s with one-hot block matrices (the key side in the input dtype, the
query side an fp32 dot of ``[M, BQ] @ [BQ, M]``); on an H200 that ∂W was wrong (relative error 2.0) at an
uneven 3D grid in bf16 and fp16 while the interpreter and the DiT shape were right
(``docs/results/gpu_check_h200_2026-11-28.md``; that run could not tell the dense path's ∂W from the
blocked path's, which its test checked second with the same message). That variant is kept behind
``backward(..., dw_method="onehot")`` (``"onehot-keys"``, ``"onehot-queries"``: one side of it) for the
next GPU run to tell which construct fails (``tests/test_triton_dense.py``); nothing else uses it.

Block ids come from an int32 table ``b(t)`` per token (:func:`token_block_table`: N ints, built on the
device once per layout and cached), loaded once per tile: the kernels read q, k, v in token order, tiles
cross block boundaries freely, and uneven grids cost nothing. Until 2026-11-28 each tile computed its
block ids from its token ids (about ten integer divisions per token) and gathered W with a masked
``[BQ, BK]`` load: compiled for an H200 (triton 3.6, ``ptxas -v``; ``benchmarks/kernel_resources.py``
prints these numbers) the forward at SANA's 1024-token shape
(d = 32, tiles of 64, 4 warps, bf16) used 255 registers per thread and spilled 428 bytes, which fits its
measured slowness there (1.19 ms against 0.25 ms for SANA's linear attention); now it uses 138 and spills
nothing. Padded tokens read block 0, so the W gather needs no mask (their rows and columns of P are
zero), token offsets are int32 where the tensors allow (:func:`_wide`), and a head dim that is a power of
two drops the column masks.

Precision, as in ``triton_mhla.py``: accumulators, row sums, ``den``, ``g_den`` and ∂W are fp32; dot
operands are the input dtype (φ(q), φ(k), v, G exactly as loaded, and the fp32 tiles A and dP cast to it;
for fp16 those are first scaled by a power of two so that their largest entry is about 2^14, as
``_dot_operand`` does for the states); fp32 inputs use TF32 iff
``torch.backends.cuda.matmul.allow_tf32``. Normalisers (Σ_s A, G·o) and ∂W's sums are fp32 reductions.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import tile_table
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
    device_name,
    heads_interleaved_empty,
)

# The crossover (defaults; a per-GPU tuning table passes its own through uses_dense_path's arguments):
# the dense path runs for at most DENSE_MAX_TOKENS tokens, DENSE_MAX_BLOCKS blocks and head dim
# DENSE_MAX_HEAD_DIM. Measured on an H200 on 2026-11-28 (docs/results/gpu_check_h200_2026-11-28.md,
# bf16, GPU time of one forward): at 256 tokens (DiT-XL/2 256 px) the dense forward took 42 µs in one
# launch against about 70 µs for the blocked path's four; at 1024 tokens (SANA 1024 px) it took 1.19 ms
# against 0.25 ms for SANA's linear attention, so 1024 was far past the crossover (it was the default
# until then). DENSE_BLOCK_LIMIT is a hard limit, also for a forced dense path: each program of the dW
# pass keeps an fp32 [BQ, next power of two of M] accumulator.
DENSE_MAX_TOKENS = 256
DENSE_MAX_BLOCKS = 64
DENSE_MAX_HEAD_DIM = 128
DENSE_BLOCK_LIMIT = 128
PATHS = ("auto", "dense", "blocked")
# ∂W in kernel 1: masked sums (the default); the one-hot dots of before 2026-11-28 on both sides, or on
# the key side or the query side only (for GPU checks: which construct fails, tests/test_triton_dense.py)
DW_METHODS = ("sums", "onehot", "onehot-keys", "onehot-queries")

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


# --------------------------------------------------------------------------------------------------
# launch parameters and the token -> block table


@dataclass(frozen=True)
class DenseTiles:
    """Launch parameters of the dense kernels: query and key tile lengths, warps per program and the
    depth of the key (query) loop's software pipeline (None: Triton's default)."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int | None = None


def dense_tiles(d: int, e: int, override: TileConfig | None = None, *, num_tokens: int | None = None,
                dtype: torch.dtype | None = None, device: torch.device | None = None) -> DenseTiles:
    """Each field from ``override`` (``block_t`` sets both tile lengths, rounded up to a power of two >= 16,
    what ``tl.dot`` needs; ``num_warps``, ``num_stages``), else from the tile table entry of this device
    and dense shape class (``tile_table.dense_shape_class``; only when ``num_tokens``, ``dtype`` and
    ``device`` are given), else the heuristic: tiles of 64 tokens and 4 warps for head dims up to 64, else
    32 and 8 (full d and e per program, like the blocked kernels); Triton's default pipeline depth."""
    override = override or TileConfig()
    tuned = {}
    if num_tokens is not None and dtype is not None and device is not None:
        key = tile_table.dense_shape_class(d, e, dtype, num_tokens)
        tuned = tile_table.lookup(device_name(torch.device(device)), key)

    def pick(name: str, default):
        value = getattr(override, name)
        return value if value is not None else tuned.get(name, default)

    wide = max(_pow2(d), _pow2(e)) > 64
    block = _pow2(pick("block_t", 32 if wide else 64))
    return DenseTiles(block, block, pick("num_warps", 8 if wide else 4), pick("num_stages", None))


_token_tables: dict[tuple, torch.Tensor] = {}  # (grid, blocks, device) -> int32 (N,), see token_block_table


def token_block_table(grid: Sequence[int], blocks: Sequence[int], device) -> torch.Tensor:
    """int32 ``(N,)``: the block ``b(t)`` of each row-major token t, as ``BlockLayout.block_index``.

    Built with device ops (an axis of length L in b blocks: the first ``L mod b`` blocks one token longer;
    block ids row-major over the block grid), nothing copied from the host, and cached per layout and
    device (4 bytes a token); while a CUDA graph is being captured a missing table is built inside the
    capture and not cached (the graph then rebuilds it each replay: a few tiny kernels)."""
    geometry = _Geometry.of(grid, blocks)
    device = torch.device(device)
    key = (geometry.grid, geometry.blocks, device)
    table = _token_tables.get(key)
    if table is not None:
        return table
    ids = torch.zeros((), dtype=torch.int32, device=device)
    for length, parts in zip(geometry.grid, geometry.blocks):
        base, extra = divmod(length, parts)
        x = torch.arange(length, dtype=torch.int32, device=device)
        long_end = extra * (base + 1)
        axis_ids = torch.where(x < long_end, x // (base + 1), extra + (x - long_end).clamp_min(0) // base)
        ids = ids.unsqueeze(-1) * parts + axis_ids
    table = ids.reshape(-1)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing:
        _token_tables[key] = table
    return table


def key_tile_span(grid: Sequence[int], blocks: Sequence[int], block_k: int) -> int:
    """The most block ids a key tile of ``block_k`` consecutive tokens ranges over (largest - smallest + 1,
    over all tiles): how many masked sums ∂W's key side unrolls per tile (``_add_key_block_sums``); 0 when
    it would be more than MAX_UNROLLED_SPAN (the kernel then loops). Computed on the CPU, cached."""
    return _key_tile_span(_Geometry.of(grid, blocks), block_k)


MAX_UNROLLED_SPAN = 16


@functools.lru_cache(maxsize=256)
def _key_tile_span(geometry: _Geometry, block_k: int) -> int:
    ids = token_block_table(geometry.grid, geometry.blocks, "cpu").long()
    pad = (-ids.numel()) % block_k
    tiles = torch.nn.functional.pad(ids, (0, pad), value=-1).view(-1, block_k)
    smallest = torch.where(tiles >= 0, tiles, ids.max() + 1).min(dim=1).values
    span = int((tiles.max(dim=1).values - smallest).max()) + 1
    return span if span <= MAX_UNROLLED_SPAN else 0


# --------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _offsets(tok, stride_n, o_c, stride_c, WIDE: tl.constexpr):
    """Element offsets ``[len(tok), len(o_c)]`` of rows ``tok``, columns ``o_c`` from a (batch, head)'s
    base pointer: int32 unless WIDE (the host checks that the largest offset fits, :func:`_wide`)."""
    if WIDE:
        tok = tok.to(tl.int64)
    return tok[:, None] * stride_n + o_c[None, :] * stride_c


@triton.jit
def _tile_mask(m_t, m_c, EVEN: tl.constexpr):
    """The ``[len(m_t), len(m_c)]`` mask of a row tile; EVEN (the head dim is the tile's): rows only."""
    if EVEN:
        mask = m_t[:, None]
    else:
        mask = m_t[:, None] & m_c[None, :]
    return mask


@triton.jit
def _rows(base, tok, m_t, stride_n, o_c, m_c, stride_c, EVEN: tl.constexpr, WIDE: tl.constexpr):
    """Tile ``[len(tok), len(o_c)]`` of a (N, C) matrix at ``base`` (rows ``tok``, columns ``o_c``) in its
    own dtype; zero outside the masks."""
    ptrs = base + _offsets(tok, stride_n, o_c, stride_c, WIDE)
    return tl.load(ptrs, mask=_tile_mask(m_t, m_c, EVEN), other=0.0)


@triton.jit
def _store_rows(base, tok, m_t, stride_n, o_c, m_c, stride_c, x, EVEN: tl.constexpr, WIDE: tl.constexpr):
    """Store the fp32 tile ``x`` ``[len(tok), len(o_c)]`` into rows ``tok`` of the (N, C) matrix at ``base``,
    in that matrix's dtype, inside the masks."""
    ptrs = base + _offsets(tok, stride_n, o_c, stride_c, WIDE)
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=_tile_mask(m_t, m_c, EVEN))


@triton.jit
def _feature_rows(base, tok, m_t, stride_n, o_c, m_c, stride_c, FEATURE: tl.constexpr, EVEN: tl.constexpr,
                  WIDE: tl.constexpr):
    """``(x, φ(x))`` fp32 tiles of q or k rows ``tok``; φ is zeroed outside the masks (φ(0) = 1 for elu+1)."""
    x = _rows(base, tok, m_t, stride_n, o_c, m_c, stride_c, EVEN, WIDE).to(tl.float32)
    return x, tl.where(_tile_mask(m_t, m_c, EVEN), _phi(x, FEATURE), 0.0)


@triton.jit
def _mixing_tile(w_rows, blk_k):
    """``W[b(t), b(s)]`` fp32 ``[BQ, BK]`` from ``w_rows = w + b(t)·M`` (``[BQ]`` pointers into the contiguous
    (M, M) table) and the key tile's block ids. Unmasked: a padded token has block 0 (:func:`_tile_blocks`),
    a valid entry; its row or column of P is zero, so the value it reads never counts."""
    return tl.load(w_rows[:, None] + blk_k[None, :])


@triton.jit
def _tile_blocks(blocks, tok, m_t):
    """int32 ``b(t)`` of a tile's token ids from the token -> block table; 0 for padding (``tok >= N``)."""
    return tl.load(blocks + tok, mask=m_t, other=0)


@triton.jit
def _scaled_dot(a, b, DOT_DTYPE: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` in fp32 for an fp32 tile ``a`` (A, dP, dA ∘ P) cast to the dot dtype (scaled into fp16's
    range first where SCALE, see ``_dot_operand``); ``b`` already in the dot dtype."""
    a_op, c = _dot_operand(a, DOT_DTYPE, SCALE)
    return tl.dot(a_op, b, input_precision=PRECISION) * c


@triton.jit
def _add_block_sum(acc, x, blk_k, m_k, o_m, j):
    """``acc[t, j] += Σ_{s in the tile, b(s) = j} x[t, s]``: a masked row sum of ``x`` ``[BQ, BK]`` into
    column j of ``acc`` ``[BQ, BM]`` (fp32; adding 0 leaves the other columns exactly as they were)."""
    in_j = (blk_k == j) & m_k  # [BK]
    col = tl.sum(tl.where(in_j[None, :], x, 0.0), axis=1)  # [BQ]
    return acc + tl.where(o_m[None, :] == j, col[:, None], 0.0)


@triton.jit
def _add_key_block_sums(acc, x, blk_k, m_k, o_m, SPAN: tl.constexpr):
    """:func:`_add_block_sum` for every key block of the tile: the block ids from the tile's smallest on,
    SPAN of them unrolled (the host's bound on ``largest - smallest + 1`` over the tiles,
    :func:`key_tile_span`), so that the key loop has no inner loop and Triton pipelines its loads; SPAN = 0:
    a loop up to the tile's largest id."""
    j_first = tl.min(tl.where(m_k, blk_k, 2147483647), axis=0)
    if SPAN > 0:
        for jj in tl.static_range(SPAN):
            acc = _add_block_sum(acc, x, blk_k, m_k, o_m, j_first + jj)
    else:
        j_last = tl.max(tl.where(m_k, blk_k, -1), axis=0)
        for j in range(j_first, j_last + 1):
            acc = _add_block_sum(acc, x, blk_k, m_k, o_m, j)
    return acc


@triton.jit
def _store_query_block_sums(p_dw, acc, blk_q, m_q, o_m, M):
    """``p_dw[i, j] = Σ_{t in the tile, b(t) = i} acc[t, j]`` (row-major ``M x M`` at ``p_dw``) for the query
    blocks i of the tile; the other rows are left as they are (zero: the host zeroes the buffer)."""
    i_first = tl.min(tl.where(m_q, blk_q, 2147483647), axis=0)
    i_last = tl.max(tl.where(m_q, blk_q, -1), axis=0)
    for i in range(i_first, i_last + 1):
        in_i = (blk_q == i) & m_q  # [BQ]
        row = tl.sum(tl.where(in_i[:, None], acc, 0.0), axis=0)  # [BM]
        tl.store(p_dw + i * M + o_m, row, mask=o_m < M)


@triton.jit
def _store_onehot_dw(p_dw, acc, blk_q, m_q, o_m, M):
    """The one-hot variant's query side (``dw_method="onehot"``, as before 2026-11-28): all M rows of
    ``p_dw`` from ``onehot(b(t))ᵀ acc``, an fp32 ``[BM, BQ] @ [BQ, BM]`` dot."""
    onehot_q = ((blk_q[:, None] == o_m[None, :]) & m_q[:, None]).to(tl.float32)  # [BQ, BM]
    b_dw = tl.dot(tl.trans(onehot_q), acc, input_precision="ieee")
    tl.store(p_dw + o_m[:, None] * M + o_m[None, :], b_dw, mask=(o_m[:, None] < M) & (o_m[None, :] < M))


# --------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _dense_fwd_kernel(
    q, k, v, w, blocks, out, den,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_ob, stride_oh, stride_on, stride_oe,
    H, N, M, D, E, eps,
    FEATURE: tl.constexpr, NORMALIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    SCALE: tl.constexpr, CLIP_FP16: tl.constexpr, EVEN: tl.constexpr, WIDE: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
):
    """o_t = Σ_s A[t, s] v_s / den_t for one tile of BQ query tokens of one (batch, head).

    Grid (cdiv(N, BQ), B*H). ``blocks``: int32 (N,) token -> block table. Writes ``den`` (B, H, N)
    contiguous fp32 (with the normaliser).
    """
    i_q, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    tok_q = i_q * BQ + tl.arange(0, BQ)  # [BQ] token ids, row-major on the grid
    m_q = tok_q < N
    w_rows = w + _tile_blocks(blocks, tok_q, m_q) * M  # W[b(t), :] of the query tokens
    _, b_fq = _feature_rows(q + i_b * stride_qb + i_h * stride_qh, tok_q, m_q, stride_qn, o_d, m_d,
                            stride_qd, FEATURE, EVEN, WIDE)
    b_fq = b_fq.to(DOT_DTYPE)  # φ(Q) [BQ, BD]
    k_base = k + i_b * stride_kb + i_h * stride_kh
    v_base = v + i_b * stride_vb + i_h * stride_vh

    acc = tl.zeros([BQ, BE], dtype=tl.float32)  # Σ_s A[t, s] v_s
    rowsum = tl.zeros([BQ], dtype=tl.float32)  # Σ_s A[t, s]
    for s0 in range(0, N, BK):
        tok_k = s0 + tl.arange(0, BK)
        m_k = tok_k < N
        blk_k = _tile_blocks(blocks, tok_k, m_k)
        _, b_fk = _feature_rows(k_base, tok_k, m_k, stride_kn, o_d, m_d, stride_kd, FEATURE, EVEN, WIDE)
        b_v = _rows(v_base, tok_k, m_k, stride_vn, o_e, m_e, stride_ve, EVEN, WIDE).to(DOT_DTYPE)  # [BK, BE]
        b_p = tl.dot(b_fq, tl.trans(b_fk.to(DOT_DTYPE)), input_precision=PRECISION)  # P [BQ, BK]
        b_a = b_p * _mixing_tile(w_rows, blk_k)  # A = P ∘ W[b(t), b(s)]
        if NORMALIZE:
            rowsum += tl.sum(b_a, axis=1)
        acc += _scaled_dot(b_a, b_v, DOT_DTYPE, SCALE, PRECISION)

    if NORMALIZE:
        b_den = rowsum + eps
        acc = acc / b_den[:, None]
        tl.store(den + i_bh.to(tl.int64) * N + tok_q, b_den, mask=m_q)
    if CLIP_FP16:
        acc = tl.minimum(tl.maximum(acc, -65504.0), 65504.0)
    _store_rows(out + i_b * stride_ob + i_h * stride_oh, tok_q, m_q, stride_on, o_e, m_e, stride_oe, acc,
                EVEN, WIDE)


@triton.jit
def _query_prologue(g_base, o_base, den, gden, row0, tok_q, m_q, stride_gn, stride_ge, stride_on, stride_oe,
                    o_e, m_e, NORMALIZE: tl.constexpr, STORE_GDEN: tl.constexpr, EVEN: tl.constexpr,
                    WIDE: tl.constexpr):
    """``(G, 1/den, g_den)`` of a query tile: G [BQ, BE] as loaded; fp32 [BQ] ``1/den_t`` and
    ``g_den_t = -(G_t·o_t)/den_t`` (1 and 0 without the normaliser). ``row0``: offset of this (batch,
    head) in the (B, H, N) buffers ``den`` and ``gden``; STORE_GDEN writes g_den there."""
    b_g = _rows(g_base, tok_q, m_q, stride_gn, o_e, m_e, stride_ge, EVEN, WIDE)
    b_rden = tl.full(tok_q.shape, 1.0, tl.float32)
    b_gden = tl.zeros(tok_q.shape, tl.float32)
    if NORMALIZE:
        b_rden = 1.0 / tl.load(den + row0 + tok_q, mask=m_q, other=1.0)
        b_o = _rows(o_base, tok_q, m_q, stride_on, o_e, m_e, stride_oe, EVEN, WIDE).to(tl.float32)
        b_gden = -tl.sum(b_g.to(tl.float32) * b_o, axis=1) * b_rden
        if STORE_GDEN:
            tl.store(gden + row0 + tok_q, b_gden, mask=m_q)
    return b_g, b_rden, b_gden


@triton.jit
def _dense_dq_kernel(
    q, k, v, w, blocks, g, o, den, gden, dq, dw,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_gb, stride_gh, stride_gn, stride_ge,
    stride_ob, stride_oh, stride_on, stride_oe,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    BH, H, N, M, D, E,
    FEATURE: tl.constexpr, NORMALIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    SCALE: tl.constexpr, STORE_GDEN: tl.constexpr, COMPUTE_DQ: tl.constexpr, COMPUTE_DW: tl.constexpr,
    ONEHOT_K: tl.constexpr, ONEHOT_Q: tl.constexpr, SPAN: tl.constexpr,
    EVEN: tl.constexpr, WIDE: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr,
):
    """Backward over one query tile: g_den (for kernel 2), dq and this program's ∂W partial.

    Grid (cdiv(N, BQ), B*H). Per key tile, with dA[t, s] = (G_t·v_s)/den_t + g_den_t:
        dφ(q) += (W[b(t), b(s)] ∘ dA) φ(K)        acc_dw[t, j] += Σ_{s∈j} dA[t, s] P[t, s]
    Writes ``gden`` (B, H, N) fp32 (STORE_GDEN) and ``dw`` (cdiv(N, BQ), B*H, M, M) fp32, zeroed by the host,
    program (i_q, bh) its own ``[M, M]`` slice: ``Σ_{t∈i, s∈j}`` over its query tokens t and all keys s.
    ONEHOT_K / ONEHOT_Q: the key-side / query-side sums as one-hot ``tl.dot``s (as before 2026-11-28; for
    GPU checks only, ``backward(dw_method=...)``).
    """
    i_q, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    o_d, o_e, o_m = tl.arange(0, BD), tl.arange(0, BE), tl.arange(0, BM)
    m_d, m_e = o_d < D, o_e < E
    tok_q = i_q * BQ + tl.arange(0, BQ)
    m_q = tok_q < N
    blk_q = _tile_blocks(blocks, tok_q, m_q)
    w_rows = w + blk_q * M
    b_g, b_rden, b_gden = _query_prologue(
        g + i_b * stride_gb + i_h * stride_gh, o + i_b * stride_ob + i_h * stride_oh, den, gden,
        i_bh.to(tl.int64) * N, tok_q, m_q, stride_gn, stride_ge, stride_on, stride_oe, o_e, m_e,
        NORMALIZE, STORE_GDEN, EVEN, WIDE)
    if COMPUTE_DQ or COMPUTE_DW:
        b_q, b_fq = _feature_rows(q + i_b * stride_qb + i_h * stride_qh, tok_q, m_q, stride_qn, o_d, m_d,
                                  stride_qd, FEATURE, EVEN, WIDE)
        b_fq_op, b_g_op = b_fq.to(DOT_DTYPE), b_g.to(DOT_DTYPE)
        acc_dfq = tl.zeros([BQ, BD], dtype=tl.float32)  # dφ(q)
        acc_dw = tl.zeros([BQ, BM], dtype=tl.float32)  # [t, j]: Σ_{s∈j} dA[t, s] P[t, s]
        k_base = k + i_b * stride_kb + i_h * stride_kh
        v_base = v + i_b * stride_vb + i_h * stride_vh
        for s0 in range(0, N, BK):
            tok_k = s0 + tl.arange(0, BK)
            m_k = tok_k < N
            blk_k = _tile_blocks(blocks, tok_k, m_k)
            _, b_fk = _feature_rows(k_base, tok_k, m_k, stride_kn, o_d, m_d, stride_kd, FEATURE, EVEN, WIDE)
            b_fk = b_fk.to(DOT_DTYPE)  # [BK, BD]
            b_v = _rows(v_base, tok_k, m_k, stride_vn, o_e, m_e, stride_ve, EVEN, WIDE).to(DOT_DTYPE)
            b_da = tl.dot(b_g_op, tl.trans(b_v), input_precision=PRECISION)  # G_t·v_s [BQ, BK]
            b_da = b_da * b_rden[:, None] + b_gden[:, None]  # dA
            if COMPUTE_DQ:
                b_dp = b_da * _mixing_tile(w_rows, blk_k)  # dP = W[b(t), b(s)] ∘ dA
                acc_dfq += _scaled_dot(b_dp, b_fk, DOT_DTYPE, SCALE, PRECISION)
            if COMPUTE_DW:
                b_p = tl.dot(b_fq_op, tl.trans(b_fk), input_precision=PRECISION)  # P [BQ, BK]
                if ONEHOT_K:
                    onehot_k = ((blk_k[:, None] == o_m[None, :]) & m_k[:, None]).to(DOT_DTYPE)  # [BK, BM]
                    acc_dw += _scaled_dot(b_da * b_p, onehot_k, DOT_DTYPE, SCALE, PRECISION)
                else:
                    acc_dw = _add_key_block_sums(acc_dw, b_da * b_p, blk_k, m_k, o_m, SPAN)

        if COMPUTE_DQ:
            dq_base = dq + i_b * stride_dqb + i_h * stride_dqh
            _store_rows(dq_base, tok_q, m_q, stride_dqn, o_d, m_d, stride_dqd, acc_dfq * _dphi(b_q, FEATURE),
                        EVEN, WIDE)
        if COMPUTE_DW:
            p_dw = dw + (i_q * BH + i_bh).to(tl.int64) * M * M
            if ONEHOT_Q:
                _store_onehot_dw(p_dw, acc_dw, blk_q, m_q, o_m, M)
            else:
                _store_query_block_sums(p_dw, acc_dw, blk_q, m_q, o_m, M)


@triton.jit
def _dense_dkv_kernel(
    q, k, v, w, blocks, g, den, gden, dk, dv,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_gb, stride_gh, stride_gn, stride_ge,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dve,
    H, N, M, D, E,
    FEATURE: tl.constexpr, NORMALIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    SCALE: tl.constexpr, COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr, EVEN: tl.constexpr,
    WIDE: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
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
    blk_k = _tile_blocks(blocks, tok_k, m_k)
    b_k, b_fk = _feature_rows(k + i_b * stride_kb + i_h * stride_kh, tok_k, m_k, stride_kn, o_d, m_d,
                              stride_kd, FEATURE, EVEN, WIDE)
    b_fk_op = b_fk.to(DOT_DTYPE)  # [BK, BD]
    b_v = _rows(v + i_b * stride_vb + i_h * stride_vh, tok_k, m_k, stride_vn, o_e, m_e, stride_ve, EVEN, WIDE)
    b_v = b_v.to(DOT_DTYPE)  # [BK, BE]
    row0 = i_bh.to(tl.int64) * N  # this (batch, head) in den and gden
    q_base = q + i_b * stride_qb + i_h * stride_qh
    g_base = g + i_b * stride_gb + i_h * stride_gh

    acc_dfk = tl.zeros([BK, BD], dtype=tl.float32)
    acc_dv = tl.zeros([BK, BE], dtype=tl.float32)
    for t0 in range(0, N, BQ):
        tok_q = t0 + tl.arange(0, BQ)
        m_q = tok_q < N
        _, b_fq = _feature_rows(q_base, tok_q, m_q, stride_qn, o_d, m_d, stride_qd, FEATURE, EVEN, WIDE)
        b_fq = b_fq.to(DOT_DTYPE)  # [BQ, BD]
        b_g = _rows(g_base, tok_q, m_q, stride_gn, o_e, m_e, stride_ge, EVEN, WIDE).to(DOT_DTYPE)  # [BQ, BE]
        b_w = _mixing_tile(w + _tile_blocks(blocks, tok_q, m_q) * M, blk_k)  # [BQ, BK]
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
                    acc_dfk * _dphi(b_k, FEATURE), EVEN, WIDE)
    if COMPUTE_DV:
        _store_rows(dv + i_b * stride_dvb + i_h * stride_dvh, tok_k, m_k, stride_dvn, o_e, m_e, stride_dve,
                    acc_dv, EVEN, WIDE)


# --------------------------------------------------------------------------------------------------
# host side: the contract of triton_mhla.forward / backward (``mhla.py``), same arguments


def _wide(*tensors: torch.Tensor | None) -> bool:
    """Whether some (N, C) slice of a (B, H, N, C) tensor has an element offset beyond int32 (the kernels
    then compute token offsets in int64)."""
    def largest(t: torch.Tensor) -> int:
        return sum((size - 1) * abs(stride) for size, stride in zip(t.shape[2:], t.stride()[2:]))

    return any(t is not None and t.numel() > 0 and largest(t) >= 2**31 for t in tensors)


def _constexprs(dtype: torch.dtype, feature_map: str, tiles: DenseTiles, d: int, e: int, *tensors) -> dict:
    """Constexpr and launch kwargs shared by the three kernels (``tensors``: those whose rows they read or
    write)."""
    dot_dtype = _DOT_DTYPES[dtype]
    stages = {} if tiles.num_stages is None else {"num_stages": tiles.num_stages}
    return dict(FEATURE=FEATURE_IDS[feature_map], DOT_DTYPE=dot_dtype, PRECISION=_precision(dtype),
                SCALE=dot_dtype == tl.float16, EVEN=d == _pow2(d) and e == _pow2(e), WIDE=_wide(*tensors),
                BQ=tiles.block_q, BK=tiles.block_k, BD=_pow2(d), BE=_pow2(e), num_warps=tiles.num_warps,
                **stages)


def _mixing_table(mixing: torch.Tensor) -> torch.Tensor:
    """W as the kernels gather it: (M, M) contiguous fp32 (no copy when it already is)."""
    return mixing.to(torch.float32).contiguous()


def _tiles(q, v, config: TileConfig | None) -> DenseTiles:
    """The launch parameters of this call (override, tile table, heuristic: :func:`dense_tiles`)."""
    return dense_tiles(q.shape[-1], v.shape[-1], config, num_tokens=q.shape[2], dtype=q.dtype,
                       device=q.device)


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
    tiles = _tiles(q, v, config)
    out, state, norm, den = forward_outputs_like(q, v, blocks, normalize)
    _dense_fwd_kernel[(triton.cdiv(n, tiles.block_q), b * h)](
        q, k, v, _mixing_table(mixing), token_block_table(grid, blocks, q.device), out,
        den if normalize else q, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        h, n, geometry.num_blocks, d, e, float(eps),
        NORMALIZE=normalize, CLIP_FP16=q.dtype == torch.float16,
        **_constexprs(q.dtype, feature_map, tiles, d, e, q, k, v, out),
    )
    return out, state, norm, den


def backward(grad_out, q, k, v, grid: Sequence[int], blocks: Sequence[int], mixing, feature_map: str,
             normalize: bool, eps: float, out, state, norm, den, needs: Sequence[bool], *,
             config: TileConfig | None = None, dw_method: str = "sums"):
    """Gradients ``(dq, dk, dv, dmixing)`` of :func:`forward`, None where ``needs[i]`` is False: at most two
    launches, kernel 1 (query tiles: g_den, dq, ∂W partials) then kernel 2 (key tiles: dk, dv); with ∂W
    also a memset of the partials and their ``torch.sum``.

    Arguments as ``triton_mhla.backward``; of the saved tensors only ``den`` is read (eps is in it). dq, dk,
    dv in the dtypes of q, k, v on heads-interleaved memory; dmixing ``(M, M)`` in mixing's dtype.
    ``dw_method``: ``"sums"`` (masked fp32 sums, the default); ``"onehot"`` (the one-hot dots of before
    2026-11-28, wrong on an H200 at an uneven 3D grid), ``"onehot-keys"`` or ``"onehot-queries"`` (one side
    of them): kept only to find out on a GPU which construct fails.
    """
    if dw_method not in DW_METHODS:
        raise ValueError(f"unknown dw_method {dw_method!r}; choose one of {DW_METHODS}")
    geometry = _Geometry.of(grid, blocks)
    _check(q, k, v, mixing, geometry, feature_map)
    need_q, need_k, need_v, need_w = (bool(x) for x in needs)
    b, h, n, d = q.shape
    tiles = _tiles(q, v, config)
    w, table = _mixing_table(mixing), token_block_table(grid, blocks, q.device)
    # g_den (B, H, N) fp32, written by kernel 1 for kernel 2
    gden = q.new_empty(b, h, n, dtype=torch.float32) if normalize and (need_k or need_v) else None
    dq, dmixing = None, None
    if need_q or need_w or gden is not None:
        dq, dmixing = _query_pass(grad_out, q, k, v, geometry, w, table, feature_map, normalize, out, den,
                                  gden, need_q, need_w, tiles, dw_method)
        dmixing = None if dmixing is None else dmixing.to(mixing.dtype)
    dk, dv = None, None
    if need_k or need_v:
        dk, dv = _key_pass(grad_out, q, k, v, geometry, w, table, feature_map, normalize, den, gden, need_k,
                           need_v, tiles)
    return dq, dk, dv, dmixing


def _query_pass(grad_out, q, k, v, geometry: _Geometry, w, table, feature_map: str, normalize: bool, out, den,
                gden, need_q: bool, need_w: bool, tiles: DenseTiles, dw_method: str):
    """Kernel 1: ``(dq, dW)`` (None where not needed); writes ``gden`` when given. dW ``(M, M)`` fp32 is
    the sum of the programs' ``(M, M)`` partials over query tiles and batch·heads (``torch.sum``: a fixed
    reduction order, no atomics); the partials buffer is zeroed first (a program writes only the rows of
    the query blocks its tile touches)."""
    b, h, n, d = q.shape
    e, m = v.shape[-1], geometry.num_blocks
    num_q_tiles = triton.cdiv(n, tiles.block_q)
    dq = heads_interleaved_empty(b, h, n, d, q) if need_q else None
    partials = q.new_zeros(num_q_tiles, b * h, m, m, dtype=torch.float32) if need_w else None
    _dense_dq_kernel[(num_q_tiles, b * h)](
        q, k, v, w, table, grad_out, out, den if normalize else q, _ptr(gden, q), _ptr(dq, q),
        _ptr(partials, q),
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *_strides(out, 4), *_strides(dq, 4),
        b * h, h, n, m, d, e,
        NORMALIZE=normalize, STORE_GDEN=gden is not None, COMPUTE_DQ=need_q, COMPUTE_DW=need_w,
        ONEHOT_K=dw_method in ("onehot", "onehot-keys"), ONEHOT_Q=dw_method in ("onehot", "onehot-queries"),
        SPAN=key_tile_span(geometry.grid, geometry.blocks, tiles.block_k), BM=_pow2(m),
        **_constexprs(q.dtype, feature_map, tiles, d, e, q, k, v, grad_out, out if normalize else None, dq),
    )
    return dq, None if partials is None else partials.sum(dim=(0, 1))


def _key_pass(grad_out, q, k, v, geometry: _Geometry, w, table, feature_map: str, normalize: bool, den, gden,
              need_k: bool, need_v: bool, tiles: DenseTiles):
    """Kernel 2: ``(dk, dv)`` (None where not needed), reading den and g_den (with the normaliser)."""
    b, h, n, d = k.shape
    e = v.shape[-1]
    dk = heads_interleaved_empty(b, h, n, d, k) if need_k else None
    dv = heads_interleaved_empty(b, h, n, e, v) if need_v else None
    _dense_dkv_kernel[(triton.cdiv(n, tiles.block_k), b * h)](
        q, k, v, w, table, grad_out, den if normalize else q, _ptr(gden, q), _ptr(dk, q), _ptr(dv, q),
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *_strides(dk, 4), *_strides(dv, 4),
        h, n, geometry.num_blocks, d, e,
        NORMALIZE=normalize, COMPUTE_DK=need_k, COMPUTE_DV=need_v,
        **_constexprs(q.dtype, feature_map, tiles, d, e, q, k, v, grad_out, dk, dv),
    )
    return dk, dv


__all__ = [
    "DENSE_BLOCK_LIMIT",
    "DENSE_MAX_BLOCKS",
    "DENSE_MAX_HEAD_DIM",
    "DENSE_MAX_TOKENS",
    "DW_METHODS",
    "DenseTiles",
    "backward",
    "dense_tiles",
    "forward",
    "forward_outputs_like",
    "ran_dense",
    "token_block_table",
    "triton_path",
    "uses_dense_path",
]
