"""Triton kernels for non-causal MHLA on CUDA: forward and backward, the registered op's ``"triton"``
backend (``mhla.py`` has the contract: :func:`forward`, :func:`backward` and their ``*_outputs_like``).

Import this module only where ``triton`` is importable (the registered op imports it when the Triton
backend first runs); ``import mhla_gen`` does not import it. With ``TRITON_INTERPRET=1`` set before
``triton`` is first imported, the kernels run on CPU tensors in Triton's interpreter: that is how the
tests check them without a GPU (``tests/test_triton_mhla.py``).

Math (``b(t)`` = block of token t, ``W`` the ``M x M`` mixing matrix, φ the feature map)::

    S_j = Σ_{s∈j} φ(k_s) v_sᵀ    z_j = Σ_{s∈j} φ(k_s)          (summary kernel, per key block)
    S̃_i = Σ_j W[i, j] S_j        z̃_i = Σ_j W[i, j] z_j         (mixing kernel, triton_mixing.py)
    den_t = φ(q_t)·z̃_{b(t)} + eps   o_t = φ(q_t)ᵀ S̃_{b(t)} / den_t  (output kernel, per query block)

The forward keeps the unmixed S, z for the backward (``mhla.Saved``). Backward, with ``G`` the output
gradient, ``g_num_t = G_t / den_t`` and ``g_den_t = -(G_t·o_t) / den_t`` (without normalisation
``g_num = G`` and there is no ``g_den``)::

    S̃ = W S, z̃ = W z again                                                  (mixing kernel)
    G_t·o_t = φ(q_t)·(S̃_{b(t)} G_t) / den_t                                  (dq/dS̃ kernel, per query
    dφ(q_t) = S̃_{b(t)} g_num_t + g_den_t z̃_{b(t)}                             block, one pass; S̃ G_t is
    dS̃_i = Σ_{t∈i} φ(q_t) g_num_tᵀ     dz̃_i = Σ_{t∈i} g_den_t φ(q_t)        the dot dφ(q) needs anyway)
    dW[i, j] = Σ_{batch, heads} <dS̃_i, S_j> + <dz̃_i, z_j>                  (gram kernel + its sum)
    dS_j = Σ_i W[i, j] dS̃_i            dz_j = Σ_i W[i, j] dz̃_i             (mixing kernel, Wᵀ)
    dφ(k_s) = dS_{b(s)} v_s + dz_{b(s)}   dv_s = dS_{b(s)}ᵀ φ(k_s)            (dk/dv kernel, per key block)

So the backward reads neither ``out`` (G·o comes from S̃ G_t, which needs the whole d: the dq kernel is
not tiled over d) nor k and v before the dk/dv kernel. Launches per call (all through
``triton_mixing.launch``): forward 3 (summary, mixing, output); backward with every gradient 6 (mixing,
dq/dS̃, gram, its sum, mixing back, dk/dv), fewer for subsets (no mixing of S̃ when neither dq nor the
normaliser needs it, no gram without dW, no mixing back and dk/dv without dk, dv). Before 2026-11-28 the
forward took 4 and the backward 10 (the summaries rebuilt from k and v, fp32 GEMMs and their reductions).

Each token-loop kernel's program owns one (block, batch·head) pair and loops over that block's tokens in
tiles of ``BT``; token indices come from the block's coordinates arithmetically (no padding, no index
tensors), so uneven grids (an axis of length L in b blocks: the first L % b blocks one token longer) cost
nothing extra. q, k, v, the output gradient and the outputs are read and written through their strides
(the processors pass heads-interleaved views ``(B, N, H, d).transpose(1, 2)``).

Precision. Every accumulator is fp32, and so are the normalisers z, z̃, dz̃, dz and den (tiny). Dot
operands are the input dtype (tensor cores for bf16/fp16): φ(k), φ(q), φ(q)/den and the states S̃ (output,
dq) and dS (dk, dv). The states S, S̃, dS̃, dS are *stored* in :func:`state_dtype`: bf16 for bf16 inputs,
since the kernels round S̃ and dS to bf16 for their dots anyway (S and dS̃, the mixing's inputs, take one
bf16 rounding more than before, 2^-9 relative, inside bf16's own output rounding); fp32 for fp16 inputs,
because fp16 cannot hold summaries over thousands of tokens (|S| grows with the block length; 6.5e4 is
fp16's largest value) and a scaled fp16 copy would need a power-of-two scale per (block, batch·head)
carried through the mixing (W[i, j] times block j's scale, per column) for traffic that matters only at
Wan-sized states, which Wan runs in bf16; fp32 for fp32 inputs. Where fp16 dots read an fp32 state, the
state is first scaled by a power of two so its largest entry is about 2^14 and the dot's fp32 result is
scaled back. G·o and φ(q)·z̃ are fp32 vector reductions. The mixing multiplies in fp32 on tensor cores:
tf32 dots for bf16/fp16 inputs (W rounded to tf32, 2^-11 relative; bf16 states are exact in tf32), and for
fp32 inputs ``input_precision="tf32"`` iff ``torch.backends.cuda.matmul.allow_tf32`` (else "ieee"), as for
the token kernels' fp32 dots. dW sums bf16 states as bf16 dot operands (exact products) and fp32 states
with the mixing's precision. ``TileConfig.fp32_state_dots`` keeps the states in fp32 and runs every dot
against them and the mixing in fp32 ("ieee"; no tensor cores for those; for precision comparisons).

HBM traffic per call, on paper (bf16 inputs; T = one (B, H, N, d) tensor, S = the states, M·B·H·d·e·2
bytes in bf16; z, den and W add under 1 %). The tensors that must move are 4 T forward (q, k, v, out) and
7 T backward (q, k, v, G, dq, dk, dv). Forward: k, v read and S written (summary), S read and S̃ written
(mixing), q and S̃ read and out written (output): 4 T + 4 S. Backward: S read and S̃ written (mixing), q,
G, S̃ read and dq, dS̃ written (dq/dS̃), dS̃ and S read (gram), dS̃ read and dS written (mixing back), k, v,
dS read and dk, dv written (dk/dv): 7 T + 8 S. Until 2026-11-28 (fp32 states S₃₂ = 2 S, the summaries
rebuilt from k and v, ``out`` read back for G·o) it was 4 T + 4 S₃₂ forward and 10 T + 8 S₃₂ backward:

    shape (B=2)                       T       S      forward    backward   11 T / all moved
    Wan2.1-1.3B 480p (H=12, d=128,    201 MB  118 MB 1287 MB    2371 MB    61 %
      N=32,760, M=150)                               (was 1759) (was 3918) (was 39 %)
    SANA-1.6B 4096 px (H=70, d=32,    147 MB  4.6 MB 616 MB     1076 MB    95 %
      N=16,384, M=16)                                (was 634)  (was 1553) (was 74 %)

At Wan the states still move 8 times per forward + backward, so even at copy bandwidth these kernels
would reach at most 61 % of it for the 11 tensors; at SANA the states are negligible and what is left is
the kernels' own speed. Launch parameters come from a per-GPU table tuned offline (``tile_table.py``,
``benchmarks/tune_mhla_tiles.py``) or from the heuristic of :func:`tile_config`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import tile_table
from . import triton_mixing as mixing_kernels

# feature map name -> the FEATURE constexpr of the kernels (names as in feature_maps.FEATURE_MAPS)
FEATURE_IDS = {"relu": 0, "elu+1": 1, "elu": 1, "relu+1e-6": 2, "identity": 3}
_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# --------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _phi(x, FEATURE: tl.constexpr):
    """The feature map on an fp32 tile: 0 relu, 1 elu+1, 2 relu+1e-6, 3 identity."""
    if FEATURE == 0:
        y = tl.maximum(x, 0.0)
    elif FEATURE == 1:
        y = tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))  # elu(x) + 1
    elif FEATURE == 2:
        y = tl.maximum(x, 0.0) + 1e-6
    else:
        y = x
    return y


@triton.jit
def _dphi(x, FEATURE: tl.constexpr):
    """φ'(x) on an fp32 tile (relu: 1 where x > 0; elu+1: 1 where x > 0, else exp(x); identity: 1)."""
    if FEATURE == 0 or FEATURE == 2:
        y = tl.where(x > 0, 1.0, 0.0)
    elif FEATURE == 1:
        y = tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))
    else:
        y = tl.full(x.shape, 1.0, tl.float32)
    return y


@triton.jit
def _axis_range(c, BASE, EXTRA):
    """First token and length of block ``c`` along one axis: the first EXTRA blocks have BASE + 1 tokens."""
    start = c * BASE + tl.minimum(c, EXTRA)
    length = tl.where(c < EXTRA, BASE + 1, BASE)
    return start, length


@triton.jit
def _block_box(i_m, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2):
    """Token box of block ``i_m`` (row-major over the block grid (NB0, NB1, NB2)).

    Returns the first token coordinate per axis, the box's lengths along axes 1 and 2 and its
    number of tokens.
    """
    c0 = i_m // (NB1 * NB2)
    c1 = (i_m // NB2) % NB1
    c2 = i_m % NB2
    s0, n0 = _axis_range(c0, BASE0, EXTRA0)
    s1, n1 = _axis_range(c1, BASE1, EXTRA1)
    s2, n2 = _axis_range(c2, BASE2, EXTRA2)
    return s0, s1, s2, n1, n2, n0 * n1 * n2


@triton.jit
def _block_tokens(r, s0, s1, s2, n1, n2, length, G1, G2):
    """Row-major token ids (int64) of the block's local indices ``r`` and the mask ``r < length``.

    Local index r = (l0 * n1 + l1) * n2 + l2 inside the box; the token is
    ((s0 + l0) * G1 + s1 + l1) * G2 + s2 + l2 on the (G0, G1, G2) token grid.
    """
    l0 = r // (n1 * n2)
    l1 = (r // n2) % n1
    l2 = r % n2
    tok = ((s0 + l0) * G1 + s1 + l1).to(tl.int64) * G2 + s2 + l2
    return tok, r < length


@triton.jit
def _dot_operand(x, DOT_DTYPE: tl.constexpr, SCALE: tl.constexpr):
    """A state tile (fp32 or bf16) as a dot operand: ``(x / c).to(DOT_DTYPE), c``.

    SCALE (fp16 dots on fp32 states): c is a power of two that puts max|x| near 2^14, safely inside
    fp16's range; the caller multiplies the dot's fp32 result by c. Otherwise c = 1 and x is only cast.
    """
    if SCALE:
        x = x.to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        c = tl.where(amax > 0, tl.exp2(tl.ceil(tl.log2(amax)) - 14.0), 1.0)
        y = (x / c).to(DOT_DTYPE)
    else:
        c = 1.0
        y = x.to(DOT_DTYPE)
    return y, c


# --------------------------------------------------------------------------------------------------
# kernels (the mixing and the gram are in triton_mixing.py)


@triton.jit
def _summary_kernel(
    k, v, s_out, z_out,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_ve,
    BH, H, D, E, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2,
    FEATURE: tl.constexpr, WITH_Z: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
):
    """S_j[d-tile] = Σ_{s∈j} φ(k_s)[d-tile] v_sᵀ and z_j[d-tile] = Σ_{s∈j} φ(k_s)[d-tile].

    Grid (M, B*H, cdiv(D, BD)). Writes ``s_out`` (M, B*H, D, E) in its dtype (the state dtype) and
    ``z_out`` (M, B*H, D) fp32, both contiguous.
    """
    i_m, i_bh, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    s0, s1, s2, n1, n2, length = _block_box(i_m, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2)
    o_d = i_d * BD + tl.arange(0, BD)
    o_e = tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    k_base = k + i_b * stride_kb + i_h * stride_kh
    v_base = v + i_b * stride_vb + i_h * stride_vh

    acc = tl.zeros([BD, BE], dtype=tl.float32)
    acc_z = tl.zeros([BD], dtype=tl.float32)
    for r0 in range(0, length, BT):
        tok, m_t = _block_tokens(r0 + tl.arange(0, BT), s0, s1, s2, n1, n2, length, G1, G2)
        m_kt = m_d[:, None] & m_t[None, :]
        # φ(k)ᵀ tile [BD, BT]; padded rows/columns are zeroed after φ (φ(0) = 1 for elu+1)
        b_k = tl.load(k_base + o_d[:, None] * stride_kd + tok[None, :] * stride_kn, mask=m_kt, other=0.0)
        b_fk = tl.where(m_kt, _phi(b_k.to(tl.float32), FEATURE), 0.0)
        b_v = tl.load(v_base + tok[:, None] * stride_vn + o_e[None, :] * stride_ve,
                      mask=m_t[:, None] & m_e[None, :], other=0.0)
        acc += tl.dot(b_fk.to(DOT_DTYPE), b_v.to(DOT_DTYPE), input_precision=PRECISION)
        if WITH_Z:
            acc_z += tl.sum(b_fk, axis=1)

    row = (i_m * BH + i_bh).to(tl.int64)  # (block, batch·head) row of the state buffers
    p_s = s_out + row * D * E + o_d[:, None] * E + o_e[None, :]
    tl.store(p_s, acc.to(s_out.dtype.element_ty), mask=m_d[:, None] & m_e[None, :])
    if WITH_Z:
        tl.store(z_out + row * D + o_d, acc_z, mask=m_d)


@triton.jit
def _output_kernel(
    q, s_mix, z_mix, out, den,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_ob, stride_oh, stride_on, stride_oe,
    stride_db, stride_dh, stride_dn,
    BH, H, D, E, eps, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2,
    FEATURE: tl.constexpr, NORMALIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    STATE_DTYPE: tl.constexpr, SCALE: tl.constexpr, CLIP_FP16: tl.constexpr, SPLIT: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
):
    """o_t[e-tile] = φ(q_t)ᵀ S̃_i[:, e-tile] / den_t for the tokens t of query block i.

    Grid (M * SPLIT, B*H, cdiv(E, BE)): program (i * SPLIT + s) takes the block's token tiles
    s, s + SPLIT, ... . ``s_mix`` (M, B*H, D, E) and ``z_mix`` (M, B*H, D) contiguous. The e-tile-0
    programs also write den (B, H, N).
    """
    i_ms, i_bh, i_e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_m, i_s = i_ms // SPLIT, i_ms % SPLIT
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    s0, s1, s2, n1, n2, length = _block_box(i_m, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2)
    o_d = tl.arange(0, BD)
    o_e = i_e * BE + tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E

    # the block's mixed state S̃_i[:, e-tile] [BD, BE] (and z̃_i [BD]), loaded once per program
    row = (i_m * BH + i_bh).to(tl.int64)
    p_s = s_mix + row * D * E + o_d[:, None] * E + o_e[None, :]
    b_s, c_s = _dot_operand(tl.load(p_s, mask=m_d[:, None] & m_e[None, :], other=0.0), STATE_DTYPE, SCALE)
    if NORMALIZE:
        b_z = tl.load(z_mix + row * D + o_d, mask=m_d, other=0.0)

    q_base = q + i_b * stride_qb + i_h * stride_qh
    o_base = out + i_b * stride_ob + i_h * stride_oh
    for r0 in range(i_s * BT, length, SPLIT * BT):
        tok, m_t = _block_tokens(r0 + tl.arange(0, BT), s0, s1, s2, n1, n2, length, G1, G2)
        m_qt = m_t[:, None] & m_d[None, :]
        b_q = tl.load(q_base + tok[:, None] * stride_qn + o_d[None, :] * stride_qd, mask=m_qt, other=0.0)
        b_fq = tl.where(m_qt, _phi(b_q.to(tl.float32), FEATURE), 0.0)  # [BT, BD]
        b_o = tl.dot(b_fq.to(STATE_DTYPE), b_s, input_precision=PRECISION) * c_s  # [BT, BE]
        if NORMALIZE:
            b_den = tl.sum(b_fq * b_z[None, :], axis=1) + eps  # fp32 [BT]
            b_o = b_o / b_den[:, None]
            p_den = den + i_b * stride_db + i_h * stride_dh + tok * stride_dn
            if i_e == 0:  # one e-tile writes den
                tl.store(p_den, b_den, mask=m_t)
        if CLIP_FP16:
            b_o = tl.minimum(tl.maximum(b_o, -65504.0), 65504.0)
        p_o = o_base + tok[:, None] * stride_on + o_e[None, :] * stride_oe
        tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_t[:, None] & m_e[None, :])


@triton.jit
def _dq_dstate_kernel(
    q, g, den, s_mix, z_mix, dq, ds_out, dz_out,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_gb, stride_gh, stride_gn, stride_ge,
    stride_db, stride_dh, stride_dn,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    BH, H, D, E, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2,
    FEATURE: tl.constexpr, NORMALIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    STATE_DTYPE: tl.constexpr, SCALE: tl.constexpr, COMPUTE_DQ: tl.constexpr, COMPUTE_DSTATE: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
):
    """One pass over query block i: dq, and dS̃_i, dz̃_i. Whole d and e per program (BD, BE >= D, E).

    Grid (M, B*H). Per token tile, with GS = G S̃_iᵀ [BT, D] (the dot dφ(q) needs), G·o = φ(q)·GS / den,
    g_num = G / den and g_den = -(G·o) / den:
        dφ(q) = GS / den + g_den z̃_i        dq = φ'(q) * dφ(q)
        dS̃_i += φ(q)ᵀ g_num                 dz̃_i += Σ_t g_den_t φ(q_t)
    ``s_mix`` (M, B*H, D, E) and ``z_mix`` (M, B*H, D) contiguous; writes ``ds_out`` (M, B*H, D, E) in its
    dtype (the state dtype) and ``dz_out`` (M, B*H, D) fp32, contiguous.
    """
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    s0, s1, s2, n1, n2, length = _block_box(i_m, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2)
    o_d = tl.arange(0, BD)
    o_e = tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    row = (i_m * BH + i_bh).to(tl.int64)

    if COMPUTE_DQ or NORMALIZE:  # S̃_i as a dot operand [BD, BE]; z̃_i
        p_s = s_mix + row * D * E + o_d[:, None] * E + o_e[None, :]
        b_s, c_s = _dot_operand(tl.load(p_s, mask=m_d[:, None] & m_e[None, :], other=0.0), STATE_DTYPE, SCALE)
    if COMPUTE_DQ and NORMALIZE:
        b_z = tl.load(z_mix + row * D + o_d, mask=m_d, other=0.0)

    acc_s = tl.zeros([BD, BE], dtype=tl.float32)
    acc_z = tl.zeros([BD], dtype=tl.float32)
    q_base = q + i_b * stride_qb + i_h * stride_qh
    g_base = g + i_b * stride_gb + i_h * stride_gh
    for r0 in range(0, length, BT):
        tok, m_t = _block_tokens(r0 + tl.arange(0, BT), s0, s1, s2, n1, n2, length, G1, G2)
        m_qt = m_t[:, None] & m_d[None, :]
        b_q = tl.load(q_base + tok[:, None] * stride_qn + o_d[None, :] * stride_qd, mask=m_qt, other=0.0)
        b_q = b_q.to(tl.float32)
        b_fq = tl.where(m_qt, _phi(b_q, FEATURE), 0.0)  # [BT, BD]
        b_g = tl.load(g_base + tok[:, None] * stride_gn + o_e[None, :] * stride_ge,
                      mask=m_t[:, None] & m_e[None, :], other=0.0)
        if COMPUTE_DQ or NORMALIZE:
            # GS = G S̃_iᵀ: [BT, BE] @ [BE, BD], fp32
            b_gs = tl.dot(b_g.to(STATE_DTYPE), tl.trans(b_s), input_precision=PRECISION) * c_s
        if NORMALIZE:
            b_rden = 1.0 / tl.load(den + i_b * stride_db + i_h * stride_dh + tok * stride_dn, mask=m_t,
                                   other=1.0)  # [BT]
            b_gden = -tl.sum(b_fq * b_gs, axis=1) * b_rden * b_rden  # -(G·o) / den, G·o = φ(q)·GS / den
        if COMPUTE_DQ:
            b_dfq = b_gs
            if NORMALIZE:
                b_dfq = b_gs * b_rden[:, None] + b_gden[:, None] * b_z[None, :]
            b_dq = b_dfq * _dphi(b_q, FEATURE)
            p_dq = (dq + i_b * stride_dqb + i_h * stride_dqh
                    + tok[:, None] * stride_dqn + o_d[None, :] * stride_dqd)
            tl.store(p_dq, b_dq.to(dq.dtype.element_ty), mask=m_qt)
        if COMPUTE_DSTATE:
            b_a = b_fq
            if NORMALIZE:
                b_a = b_fq * b_rden[:, None]  # φ(q_t) / den_t, so that φ(q)ᵀ G sums φ(q_t) g_num_tᵀ
                acc_z += tl.sum(b_fq * b_gden[:, None], axis=0)
            acc_s += tl.dot(tl.trans(b_a.to(DOT_DTYPE)), b_g.to(DOT_DTYPE), input_precision=PRECISION)

    if COMPUTE_DSTATE:
        p_ds = ds_out + row * D * E + o_d[:, None] * E + o_e[None, :]
        tl.store(p_ds, acc_s.to(ds_out.dtype.element_ty), mask=m_d[:, None] & m_e[None, :])
        if NORMALIZE:
            tl.store(dz_out + row * D + o_d, acc_z, mask=m_d)


@triton.jit
def _dkv_kernel(
    k, v, ds, dz, dk, dv,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_ve,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dve,
    BH, H, D, E, G1, G2, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2,
    FEATURE: tl.constexpr, NORMALIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    STATE_DTYPE: tl.constexpr, SCALE: tl.constexpr, COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr,
    SPLIT: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
):
    """dk, dv for the tokens s of key block j from dS_j (D, E) and dz_j (D):
        dφ(k_s) = dS_j v_s + dz_j     dk = φ'(k) * dφ(k)     dv_s = dS_jᵀ φ(k_s)

    Grid (M * SPLIT, B*H); ``ds`` (M, B*H, D, E) in the state dtype and ``dz`` (M, B*H, D) fp32, contiguous.
    """
    i_ms, i_bh = tl.program_id(0), tl.program_id(1)
    i_m, i_s = i_ms // SPLIT, i_ms % SPLIT
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    s0, s1, s2, n1, n2, length = _block_box(i_m, NB1, NB2, BASE0, EXTRA0, BASE1, EXTRA1, BASE2, EXTRA2)
    o_d = tl.arange(0, BD)
    o_e = tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    row = (i_m * BH + i_bh).to(tl.int64)
    p_ds = ds + row * D * E + o_d[:, None] * E + o_e[None, :]
    b_ds, c_ds = _dot_operand(tl.load(p_ds, mask=m_d[:, None] & m_e[None, :], other=0.0), STATE_DTYPE, SCALE)
    if NORMALIZE and COMPUTE_DK:
        b_dz = tl.load(dz + row * D + o_d, mask=m_d, other=0.0)

    k_base = k + i_b * stride_kb + i_h * stride_kh
    v_base = v + i_b * stride_vb + i_h * stride_vh
    for r0 in range(i_s * BT, length, SPLIT * BT):
        tok, m_t = _block_tokens(r0 + tl.arange(0, BT), s0, s1, s2, n1, n2, length, G1, G2)
        m_kt = m_t[:, None] & m_d[None, :]
        m_vt = m_t[:, None] & m_e[None, :]
        b_k = tl.load(k_base + tok[:, None] * stride_kn + o_d[None, :] * stride_kd, mask=m_kt, other=0.0)
        b_k = b_k.to(tl.float32)
        if COMPUTE_DK:
            b_v = tl.load(v_base + tok[:, None] * stride_vn + o_e[None, :] * stride_ve, mask=m_vt, other=0.0)
            b_dfk = tl.dot(b_v.to(STATE_DTYPE), tl.trans(b_ds), input_precision=PRECISION) * c_ds  # [BT, BD]
            if NORMALIZE:
                b_dfk += b_dz[None, :]
            b_dk = b_dfk * _dphi(b_k, FEATURE)
            p_dk = (dk + i_b * stride_dkb + i_h * stride_dkh
                    + tok[:, None] * stride_dkn + o_d[None, :] * stride_dkd)
            tl.store(p_dk, b_dk.to(dk.dtype.element_ty), mask=m_kt)
        if COMPUTE_DV:
            b_fk = tl.where(m_kt, _phi(b_k, FEATURE), 0.0)
            b_dv = tl.dot(b_fk.to(STATE_DTYPE), b_ds, input_precision=PRECISION) * c_ds  # [BT, BE]
            p_dv = (dv + i_b * stride_dvb + i_h * stride_dvh
                    + tok[:, None] * stride_dvn + o_e[None, :] * stride_dve)
            tl.store(p_dv, b_dv.to(dv.dtype.element_ty), mask=m_vt)


# --------------------------------------------------------------------------------------------------
# host side



def backward_reads_out(state) -> bool:
    """The backward gets G·o from the states, not from ``out`` (``mhla.Saved``): the op keeps none."""
    return False


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters. ``None`` fields are chosen by :func:`tile_config`.

    block_t: tokens per tile. block_d: d-tile of the summary kernel (<= next power of two of d).
    block_e: e-tile of the output kernel. split: programs per block in the output and dk/dv kernels
    (each takes every split-th token tile). num_warps, num_stages: of the token-loop kernels (num_stages:
    the depth of Triton's software pipelining of their loops; None is Triton's default). mix_block_c,
    mix_block_m, mix_num_warps, mix_num_stages: the mixing kernel's column tile, row tile (blocks), warps
    and pipeline depth (``triton_mixing.mix_tiles``). The dense path (``triton_dense.dense_tiles``) reads
    block_t (its query and key tiles), num_warps and num_stages. fp32_state_dots: for bf16/fp16 inputs,
    keep the states in fp32 and run the dots against them and the mixing in fp32 ("ieee") instead of the
    input dtype and tf32 (no tensor cores there; for precision comparisons).
    """

    block_t: int | None = None
    block_d: int | None = None
    block_e: int | None = None
    split: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    mix_block_c: int | None = None
    mix_block_m: int | None = None
    mix_num_warps: int | None = None
    mix_num_stages: int | None = None
    fp32_state_dots: bool = False


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs every tile dim >= 16


def device_name(device: torch.device) -> str:
    """The tile table's device key: the CUDA device's name (``"NVIDIA H200"``), else the device type."""
    return torch.cuda.get_device_properties(device).name if device.type == "cuda" else device.type


def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def tile_config(d: int, e: int, num_blocks: int, batch_heads: int, max_block_len: int, device,
                override: TileConfig | None = None, *, dtype: torch.dtype | None = None) -> TileConfig:
    """Launch parameters: each field from ``override``, else from the tile table entry of this device and
    shape class (``tile_table.py``; only with ``dtype``, the inputs' dtype), else the heuristic below.
    Nothing is timed at run time, so CUDA-graph capture sees the same launches every call.

    Heuristic: full d and e per program (d, e <= 128 for the bases: a [128, 128] fp32 accumulator is 64
    registers per thread at 8 warps); 32-token tiles for d or e above 64, else 64; the output and dk/dv
    kernels split a block over several programs only when there are fewer (block, batch·head) pairs than
    about two waves of the device. The summary and dq/dS̃ kernels are not split: at the models' shapes
    there are thousands of pairs (Wan 480p 3600, SANA 4096 px 2240 at batch 2, against 264 programs for
    two waves of an H200's 132 multiprocessors); smaller problems go to the dense path.
    """
    override = override or TileConfig()
    tuned = {}
    if dtype is not None:
        tuned = tile_table.lookup(device_name(device), tile_table.shape_class(d, e, dtype, max_block_len))

    def pick(name: str, default):
        value = getattr(override, name)
        return value if value is not None else tuned.get(name, default)

    bd, be = _pow2(d), _pow2(e)
    block_t = pick("block_t", 32 if max(bd, be) > 64 else 64)
    split = override.split
    if split is None:
        tiles = triton.cdiv(max_block_len, block_t)
        split = max(1, min(tiles, triton.cdiv(2 * _multiprocessors(device), num_blocks * batch_heads)))
    return TileConfig(
        block_t=block_t,
        block_d=pick("block_d", bd),
        block_e=pick("block_e", be),
        split=split,
        num_warps=pick("num_warps", 8 if bd * be > 64 * 64 else 4),
        num_stages=pick("num_stages", None),
        mix_block_c=pick("mix_block_c", None),
        mix_block_m=pick("mix_block_m", None),
        mix_num_warps=pick("mix_num_warps", None),
        mix_num_stages=pick("mix_num_stages", None),
        fp32_state_dots=override.fp32_state_dots,
    )


@dataclass(frozen=True)
class _Geometry:
    """The layout as the kernels see it: grid and blocks padded to 3D (leading ones)."""

    grid: tuple[int, int, int]
    blocks: tuple[int, int, int]

    @classmethod
    def of(cls, grid: Sequence[int], blocks: Sequence[int]) -> _Geometry:
        """The geometry of a layout, cached per (grid, blocks): the op passes lists, the eager path tuples."""
        return _geometry(tuple(grid), tuple(blocks))

    @classmethod
    def build(cls, grid: tuple[int, ...], blocks: tuple[int, ...]) -> _Geometry:
        grid, blocks = tuple(int(g) for g in grid), tuple(int(b) for b in blocks)
        if not 1 <= len(grid) <= 3 or len(blocks) != len(grid):
            raise ValueError(f"grid {grid} and blocks {blocks} must both be 1D, 2D or 3D")
        if any(not 1 <= b <= g for g, b in zip(grid, blocks)):
            raise ValueError(f"blocks {blocks} must be between 1 and grid {grid} per axis")
        pad = (1,) * (3 - len(grid))
        return cls(pad + grid, pad + blocks)

    @property
    def num_tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def num_blocks(self) -> int:
        return math.prod(self.blocks)

    @property
    def max_block_len(self) -> int:
        return math.prod(triton.cdiv(g, b) for g, b in zip(self.grid, self.blocks))

    def args(self) -> tuple[int, ...]:
        """G1, G2, NB1, NB2, then (BASE, EXTRA) per axis: a block along axis a has BASE or BASE + 1 tokens."""
        (_, g1, g2), (_, nb1, nb2) = self.grid, self.blocks
        per_axis = [v for g, b in zip(self.grid, self.blocks) for v in (g // b, g % b)]
        return (g1, g2, nb1, nb2, *per_axis)


@functools.lru_cache(maxsize=256)
def _geometry(grid: tuple[int, ...], blocks: tuple[int, ...]) -> _Geometry:
    return _Geometry.build(grid, blocks)  # a bad layout raises every time (exceptions are not cached)


def _check(q, k, v, mixing, geometry: _Geometry, feature_map: str) -> None:
    if feature_map not in FEATURE_IDS:
        raise ValueError(f"unknown feature_map {feature_map!r}; choose one of {sorted(FEATURE_IDS)}")
    if q.dim() != 4 or q.shape != k.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k (B, H, N, d) and v (B, H, N, e) disagree: {q.shape}, {k.shape}, {v.shape}")
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"Triton MHLA needs value dim e == key dim d, got e={v.shape[-1]}, d={q.shape[-1]}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DOT_DTYPES:
        raise ValueError(f"q, k, v must share one of fp32/fp16/bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] != geometry.num_tokens:
        raise ValueError(f"{q.shape[2]} tokens do not match grid {geometry.grid}")
    m = geometry.num_blocks
    if mixing.shape != (m, m):
        raise ValueError(f"mixing must be ({m}, {m}) for blocks {geometry.blocks}, got {tuple(mixing.shape)}")


def state_dtype(dtype: torch.dtype, fp32_state_dots: bool = False) -> torch.dtype:
    """The dtype the states S, S̃, dS̃, dS are stored in for inputs of ``dtype``: bf16 for bf16 (unless
    ``fp32_state_dots``), fp32 for fp16 and fp32 (module docstring: Precision)."""
    return torch.bfloat16 if dtype == torch.bfloat16 and not fp32_state_dots else torch.float32


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: only fp32 operands use it; they follow torch's TF32 switch."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _mixing_precision(dtype: torch.dtype, cfg: TileConfig) -> str:
    """input_precision of the mixing's fp32 dots for inputs of ``dtype``: tf32 for bf16/fp16 ("ieee" with
    ``fp32_state_dots``), torch's TF32 switch for fp32."""
    if dtype == torch.float32:
        return _precision(dtype)
    return "ieee" if cfg.fp32_state_dots else "tf32"


def _common(dtype: torch.dtype, feature_map: str, cfg: TileConfig) -> dict:
    """Constexpr and launch kwargs shared by the token-loop kernels."""
    stages = {} if cfg.num_stages is None else {"num_stages": cfg.num_stages}
    return dict(FEATURE=FEATURE_IDS[feature_map], DOT_DTYPE=_DOT_DTYPES[dtype], PRECISION=_precision(dtype),
                BT=cfg.block_t, num_warps=cfg.num_warps, **stages)


def _state_dots(dtype: torch.dtype, cfg: TileConfig) -> dict:
    """Constexpr kwargs of the dots against a state (S~ or dS): operand dtype, and the power-of-two
    scaling fp16 needs for states beyond its range."""
    state = tl.float32 if cfg.fp32_state_dots else _DOT_DTYPES[dtype]
    return dict(STATE_DTYPE=state, SCALE=state == tl.float16)


def heads_interleaved_empty(b: int, h: int, n: int, c: int, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """``(B, H, N, c)`` on ``(B, N, H, c)`` memory: the layout the processors merge heads from for free."""
    return torch.empty(b, n, h, c, dtype=dtype or like.dtype, device=like.device).transpose(1, 2)


def forward_outputs_like(q: torch.Tensor, v: torch.Tensor, blocks: Sequence[int], normalize: bool):
    """Empty ``(out, state, norm, den)`` with the shapes, dtypes and strides :func:`forward` returns (the
    op's fake implementation)."""
    (b, h, n, e), d, m = v.shape, q.shape[-1], math.prod(blocks)
    out = heads_interleaved_empty(b, h, n, e, q)
    state = q.new_empty(m, b, h, d, e, dtype=state_dtype(q.dtype)).permute(1, 2, 0, 3, 4)
    if normalize:
        norm = q.new_empty(m, b, h, d, dtype=torch.float32).permute(1, 2, 0, 3)
        den = q.new_empty(b, h, n, dtype=torch.float32)
    else:
        norm, den = q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)
    return out, state, norm, den


def _ptr(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """An optional kernel argument: ``dummy`` (a live tensor the kernel never touches) stands in for None."""
    return dummy if t is None else t


def _strides(t: torch.Tensor | None, ndim: int) -> tuple[int, ...]:
    return (0,) * ndim if t is None else t.stride()


def backward_outputs_like(q, k, v, mixing, needs: Sequence[bool]):
    """Empty tensors (or None) with the shapes, dtypes and strides :func:`backward` returns."""
    b, h, n, d = q.shape
    grads = (heads_interleaved_empty(b, h, n, d, q), heads_interleaved_empty(b, h, n, d, k),
             heads_interleaved_empty(b, h, n, v.shape[-1], v), torch.empty_like(mixing))
    return tuple(g if need else None for g, need in zip(grads, needs))


def _summaries(k, v, geometry: _Geometry, feature_map: str, with_z: bool, cfg: TileConfig):
    """Summary kernel: ``(S, z)``: S (M, B*H, d, e) in the state dtype and z (M, B*H, d) fp32 (or None),
    contiguous."""
    b, h, n, d = k.shape
    e, m = v.shape[-1], geometry.num_blocks
    s = torch.empty(m, b * h, d, e, dtype=state_dtype(k.dtype, cfg.fp32_state_dots), device=k.device)
    z = torch.empty(m, b * h, d, dtype=torch.float32, device=k.device) if with_z else None
    mixing_kernels.launch(
        _summary_kernel, (m, b * h, triton.cdiv(d, cfg.block_d)),
        k, v, s, _ptr(z, s), *k.stride(), *v.stride(), b * h, h, d, e, *geometry.args(),
        WITH_Z=with_z, BD=cfg.block_d, BE=_pow2(e), **_common(k.dtype, feature_map, cfg),
    )
    return s, z


def _mix(w, x, xz, dtype: torch.dtype, cfg: TileConfig):
    """The mixing kernel: ``(w x, w xz)`` over block-major states (M, ...), w x in the state dtype of
    inputs of ``dtype``, w xz fp32 (None for xz None)."""
    store = state_dtype(dtype, cfg.fp32_state_dots)
    tiles = mixing_kernels.mix_tiles(w.shape[0], cfg.mix_block_c, cfg.mix_block_m, cfg.mix_num_warps,
                                     cfg.mix_num_stages)
    return mixing_kernels.mix(w, x, xz, store, _mixing_precision(dtype, cfg), tiles)


def forward(q, k, v, grid: Sequence[int], blocks: Sequence[int], mixing, feature_map: str, normalize: bool,
            eps: float, *, config: TileConfig | None = None):
    """Non-causal MHLA forward (the op's ``"triton"`` backend, ``mhla.py``).

    Args:
        q, k: ``(B, H, N, d)``; v: ``(B, H, N, e)`` with e == d; one dtype of fp32/fp16/bf16; any strides.
        grid, blocks: token grid and blocks per axis, 1D/2D/3D (uneven allowed).
        mixing: ``(M, M)``, any float dtype and strides (read as fp32).
        feature_map: ``relu``, ``elu+1`` (alias ``elu``), ``relu+1e-6`` or ``identity``.
        config: launch parameters overriding :func:`tile_config` (tests, tuning).
    Returns:
        ``(out, state, norm, den)`` (the op's contract, ``mhla.Saved``):
        out ``(B, H, N, e)`` in q's dtype on heads-interleaved memory ``(B, N, H, e)`` (fp16 clipped
        to ±65504); state ``(B, H, M, d, e)``, the unmixed summaries S in :func:`state_dtype` (a permuted
        view of ``(M, B, H, d, e)`` memory); norm ``(B, H, M, d)`` fp32, the unmixed z (a view of
        ``(M, B, H, d)``), and den ``(B, H, N)`` fp32 contiguous (φ(q)·z̃ + eps); the last two are
        ``torch.empty(0)`` without normalisation. Shapes, dtypes and strides as :func:`forward_outputs_like`.
    """
    geometry = _Geometry.of(grid, blocks)
    _check(q, k, v, mixing, geometry, feature_map)
    b, h, n, d = q.shape
    e, m = v.shape[-1], geometry.num_blocks
    cfg = tile_config(d, e, m, b * h, geometry.max_block_len, q.device, config, dtype=q.dtype)

    s, z = _summaries(k, v, geometry, feature_map, normalize, cfg)
    s_mix, z_mix = _mix(mixing, s, z, q.dtype, cfg)  # S̃ (M, B*H, d, e), z̃ (M, B*H, d)
    out = heads_interleaved_empty(b, h, n, e, q)
    den = q.new_empty(b, h, n, dtype=torch.float32) if normalize else q.new_empty(0, dtype=torch.float32)
    den_out = den if normalize else None
    mixing_kernels.launch(
        _output_kernel, (m * cfg.split, b * h, triton.cdiv(e, cfg.block_e)),
        q, s_mix, _ptr(z_mix, q), out, _ptr(den_out, q),
        *q.stride(), *out.stride(), *_strides(den_out, 3), b * h, h, d, e, float(eps), *geometry.args(),
        NORMALIZE=normalize, CLIP_FP16=q.dtype == torch.float16, **_state_dots(q.dtype, cfg),
        SPLIT=cfg.split, BD=_pow2(d), BE=cfg.block_e, **_common(q.dtype, feature_map, cfg),
    )
    # outputs of a custom op may not alias each other: S and z are separate buffers, as are the empties
    state = s.view(m, b, h, d, e).permute(1, 2, 0, 3, 4)
    norm = z.view(m, b, h, d).permute(1, 2, 0, 3) if normalize else q.new_empty(0, dtype=torch.float32)
    return out, state, norm, den


def _block_rows(x: torch.Tensor) -> torch.Tensor:
    """A saved state ``(B, H, M, ...)`` as block-major rows ``(M, B·H·...)``: a view of the forward's
    ``(M, B, H, ...)`` memory (a copy for other strides)."""
    return x.movedim(2, 0).reshape(x.shape[2], -1)


def backward(grad_out, q, k, v, grid: Sequence[int], blocks: Sequence[int], mixing, feature_map: str,
             normalize: bool, eps: float, out, state, norm, den, needs: Sequence[bool], *,
             config: TileConfig | None = None):
    """Gradients ``(dq, dk, dv, dmixing)`` of :func:`forward`; None where ``needs[i]`` is False.

    Args:
        grad_out: ``(B, H, N, e)``, any strides and float dtype (read as is, cast in the kernels).
        q, k, v, grid, blocks, mixing, feature_map, normalize, eps: the forward's arguments.
        out: not read (G·o comes from S̃ in the dq kernel; the op passes an empty tensor).
        state, norm, den: what the forward returned (the unmixed S and z, any strides; den, with eps).
        needs: which of (q, k, v, mixing) need a gradient.
    Returns:
        dq, dk, dv in the dtypes of q, k, v on heads-interleaved memory like ``out``; dmixing ``(M, M)``
        in mixing's dtype. Gradients are not clipped (an fp16 overflow stays inf for loss scaling).
    """
    geometry = _Geometry.of(grid, blocks)
    _check(q, k, v, mixing, geometry, feature_map)
    need_q, need_k, need_v, need_w = (bool(x) for x in needs)
    b, h, _, d = q.shape
    e, m = v.shape[-1], geometry.num_blocks
    cfg = tile_config(d, e, m, b * h, geometry.max_block_len, q.device, config, dtype=q.dtype)
    need_state = need_k or need_v or need_w  # dS̃ feeds dW and, mixed back, dk and dv
    if not (need_q or need_state):
        return None, None, None, None
    s, z = _block_rows(state), _block_rows(norm) if normalize else None  # S, z: (M, B·H·d·e), (M, B·H·d)
    dq, ds_mix, dz_mix = _query_grads(grad_out, q, mixing, s, z, den, geometry, feature_map, normalize,
                                      need_q, need_state, cfg)
    if not need_state:
        return dq, None, None, None

    dmixing = None
    if need_w:  # dW[i, j] = Σ_{b,h} <dS̃_i, S_j> + <dz̃_i, z_j>
        split = mixing_kernels.gram_split(m, s.shape[1], _multiprocessors(q.device))
        dmixing = mixing_kernels.gram(ds_mix, s.to(ds_mix.dtype), dz_mix, z, _mixing_precision(q.dtype, cfg),
                                      mixing.dtype, split)
    if not (need_k or need_v):
        return dq, None, None, dmixing
    ds, dz = _mix(mixing.T, ds_mix, dz_mix, q.dtype, cfg)  # dS_j = Σ_i W[i, j] dS̃_i: (M, B*H, d, e)
    del ds_mix, dz_mix
    dk, dv = _key_value_grads(k, v, ds, dz, geometry, feature_map, normalize, need_k, need_v, cfg)
    return dq, dk, dv, dmixing


def _query_grads(grad_out, q, mixing, s, z, den, geometry: _Geometry, feature_map: str, normalize: bool,
                 need_q: bool, need_state: bool, cfg: TileConfig):
    """S̃ (and z̃) mixed again from the saved S, z where needed, then the dq/dS̃ kernel: ``(dq, dS̃, dz̃)``:
    dq heads-interleaved (or None), dS̃ ``(M, B*H, d, e)`` in the state dtype and dz̃ ``(M, B*H, d)`` fp32
    (None unless ``need_state``; dz̃ also None without the normaliser)."""
    b, h, n, d = q.shape
    e, m = grad_out.shape[-1], geometry.num_blocks
    s_mix = z_mix = None
    if need_q or normalize:  # S̃ for dφ(q) and for G·o; z̃ only for dφ(q)'s g_den z̃
        s_mix, z_mix = _mix(mixing, s, z if need_q and normalize else None, q.dtype, cfg)
    dq = heads_interleaved_empty(b, h, n, d, q) if need_q else None
    store = state_dtype(q.dtype, cfg.fp32_state_dots)
    ds_mix = q.new_empty(m, b * h, d, e, dtype=store) if need_state else None  # dS~
    dz_mix = q.new_empty(m, b * h, d, dtype=torch.float32) if need_state and normalize else None  # dz~
    den_in = den if normalize else None
    mixing_kernels.launch(
        _dq_dstate_kernel, (m, b * h),
        q, grad_out, _ptr(den_in, q), _ptr(s_mix, q), _ptr(z_mix, q), _ptr(dq, q), _ptr(ds_mix, q),
        _ptr(dz_mix, q),
        *q.stride(), *grad_out.stride(), *_strides(den_in, 3), *_strides(dq, 4),
        b * h, h, d, e, *geometry.args(),
        NORMALIZE=normalize, **_state_dots(q.dtype, cfg), COMPUTE_DQ=need_q, COMPUTE_DSTATE=need_state,
        BD=_pow2(d), BE=_pow2(e), **_common(q.dtype, feature_map, cfg),
    )
    return dq, ds_mix, dz_mix


def _key_value_grads(k, v, ds, dz, geometry: _Geometry, feature_map: str, normalize: bool, need_k: bool,
                     need_v: bool, cfg: TileConfig):
    """dk/dv kernel: ``(dk, dv)`` (None where not needed) from dS ``(M, B*H, d, e)`` in the state dtype
    and dz ``(M, B*H, d)`` fp32."""
    b, h, n, d = k.shape
    e, m = v.shape[-1], geometry.num_blocks
    dk = heads_interleaved_empty(b, h, n, d, k) if need_k else None
    dv = heads_interleaved_empty(b, h, n, e, v) if need_v else None
    mixing_kernels.launch(
        _dkv_kernel, (m * cfg.split, b * h),
        k, v, ds, _ptr(dz, ds), _ptr(dk, ds), _ptr(dv, ds),
        *k.stride(), *v.stride(), *_strides(dk, 4), *_strides(dv, 4),
        b * h, h, d, e, *geometry.args(),
        NORMALIZE=normalize, **_state_dots(k.dtype, cfg), COMPUTE_DK=need_k, COMPUTE_DV=need_v,
        SPLIT=cfg.split, BD=_pow2(d), BE=_pow2(e), **_common(k.dtype, feature_map, cfg),
    )
    return dk, dv


__all__ = [
    "FEATURE_IDS",
    "TileConfig",
    "backward",
    "backward_outputs_like",
    "device_name",
    "forward",
    "forward_outputs_like",
    "state_dtype",
    "tile_config",
]
