"""A Triton kernel for Wan's interleaved rotary embedding of q and k in one launch (``rope.py``'s
``"triton"`` backend).

For each token ``t`` and coordinate pair ``(2i, 2i+1)``, with ``c = cos[t, i]`` and ``s = sin[t, i]``::

    y[2i]   = x[2i] c - x[2i+1] s
    y[2i+1] = x[2i] s + x[2i+1] c

in fp32 (float64 for float64 inputs), rounded once to the input dtype on the store: the same products,
sums and rounding as :func:`~mhla_gen.ops.rope.apply_wan_rotary`, so the results are bit-identical to
it. That needs the products rounded before the sum, so the kernel is compiled with FMA contraction off
(``enable_fp_fusion=False``); with it on, ``x c - x' s`` would become one fused multiply-add and differ
from the reference in the last bit. ``inverse=True`` rotates by ``-s`` (the transposed rotation: the
backward of the forward rotation).

Each program owns ``BLOCK_N`` tokens of one batch entry of q or of k (grid axis 2 says which), loads the
cos/sin rows of those tokens once and loops over the heads. x and the output are read and written
through their strides (the processors pass heads-interleaved views ``(B, N, H, d).transpose(1, 2)``); a
row of ``d`` coordinates is loaded contiguously and split into its even and odd halves in registers.

Import this module only where ``triton`` is importable (``rope.py`` imports it when the Triton backend
first runs); with ``TRITON_INTERPRET=1`` set before ``triton`` is first imported, the kernel runs on CPU
tensors in Triton's interpreter (``tests/test_rope.py``).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@triton.jit
def _rotate_heads(x_ptr, y_ptr, sxb, sxh, sxn, sxd, syb, syh, syn, syd, cos, sin, batch, offs_n, mask_n,
                  heads, dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, COMPUTE: tl.constexpr):
    """Rotate ``BLOCK_N`` tokens of every head of one batch entry; cos, sin ``(BLOCK_N, BLOCK_D / 2)``."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_n[:, None] & (offs_d < dim)[None, :]
    x_rows = x_ptr + batch * sxb + offs_n[:, None] * sxn + offs_d[None, :] * sxd
    y_rows = y_ptr + batch * syb + offs_n[:, None] * syn + offs_d[None, :] * syd
    for h in range(heads):
        x = tl.load(x_rows + h * sxh, mask=mask, other=0.0).to(COMPUTE)  # (BLOCK_N, BLOCK_D)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_N, BLOCK_D // 2, 2)))  # (BLOCK_N, BLOCK_D / 2) each
        y_even = x_even * cos - x_odd * sin
        y_odd = x_even * sin + x_odd * cos
        y = tl.reshape(tl.join(y_even, y_odd), (BLOCK_N, BLOCK_D))  # pairs interleaved again
        tl.store(y_rows + h * syh, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_pair_kernel(
    q_ptr, k_ptr, oq_ptr, ok_ptr, cos_ptr, sin_ptr,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd,
    soqb, soqh, soqn, soqd, sokb, sokh, sokn, sokd,
    scn, sci, ssn, ssi,
    num_tokens, heads, dim,
    INVERSE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, COMPUTE: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), B, 2)``: token tile, batch entry, and 0 for q / 1 for k."""
    pid_n = tl.program_id(0)
    batch = tl.program_id(1)
    which = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, BLOCK_D // 2)  # pair index
    mask_n = offs_n < num_tokens
    mask_i = mask_n[:, None] & (offs_i < dim // 2)[None, :]
    cos = tl.load(cos_ptr + offs_n[:, None] * scn + offs_i[None, :] * sci, mask=mask_i, other=0.0)
    sin = tl.load(sin_ptr + offs_n[:, None] * ssn + offs_i[None, :] * ssi, mask=mask_i, other=0.0)
    cos = cos.to(COMPUTE)
    sin = sin.to(COMPUTE)
    if INVERSE:
        sin = -sin
    if which == 0:
        _rotate_heads(q_ptr, oq_ptr, sqb, sqh, sqn, sqd, soqb, soqh, soqn, soqd, cos, sin, batch, offs_n,
                      mask_n, heads, dim, BLOCK_N, BLOCK_D, COMPUTE)
    else:
        _rotate_heads(k_ptr, ok_ptr, skb, skh, skn, skd, sokb, sokh, sokn, sokd, cos, sin, batch, offs_n,
                      mask_n, heads, dim, BLOCK_N, BLOCK_D, COMPUTE)


def rope_pair(q: torch.Tensor, k: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor,
              inverse: bool = False, block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in one launch.

    Args:
        q, k: ``(B, H, N, d)``, one dtype of fp32/fp16/bf16/float64, d even, any strides.
        cos_half, sin_half: ``(N, d / 2)``, any float dtype and strides (``freqs_cos[0, :, 0, 0::2]``
            and ``freqs_sin[0, :, 0, 1::2]`` of Wan's tables).
        inverse: rotate by ``-sin`` (the backward).
        block_n: tokens per program (default: about 4096 elements per tile; tests pass small ones).
    Returns:
        ``(rq, rk)`` in the input dtype, each dense in its input's dimension order
        (``torch.empty_like``: a heads-interleaved input gives a heads-interleaved output).
    """
    b, h, n, d = q.shape
    rq, rk = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0:
        return rq, rk
    block_d = max(2, triton.next_power_of_2(d))
    block_n = block_n or max(1, min(64, 4096 // block_d, triton.next_power_of_2(n)))
    compute = tl.float64 if q.dtype == torch.float64 else tl.float32
    grid = (triton.cdiv(n, block_n), b, 2)
    device = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with device:
        _rope_pair_kernel[grid](
            q, k, rq, rk, cos_half, sin_half,
            *q.stride(), *k.stride(), *rq.stride(), *rk.stride(), *cos_half.stride(), *sin_half.stride(),
            n, h, d,
            INVERSE=inverse, BLOCK_N=block_n, BLOCK_D=block_d, COMPUTE=compute,
            enable_fp_fusion=False, num_warps=4,
        )
    return rq, rk
