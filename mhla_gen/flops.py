"""Floating-point operation counts of MHLA models with torch's ``FlopCounterMode``.

FlopCounterMode counts the matmul-like ATen ops (GEMMs, convolutions, attention). Two registrations make
it count MHLA models right: the registered MHLA op (``mhla_gen::mhla`` and its backward), which it does
not know, and the backward of a *grouped* convolution, whose stock formula ignores ``groups`` in the
weight gradient (it counts SANA's depthwise convolutions and MHLA's CPE as dense ones). Counts are FLOPs
(2 per multiply-add); elementwise work is not counted. Works on the ``meta`` device (shapes only).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    conv_flop_count,
    flop_registry,
    register_flop_formula,
    shape_wrapper,
)

from .ops import mhla as _mhla_op_module  # noqa: F401 - registers torch.ops.mhla_gen.*


def mhla_forward_flops(q_shape, v_shape, blocks) -> int:
    """Summaries ``2·N·d·c``, mixing ``2·M²·c·d`` and output ``2·N·d·c`` per (batch, head), c = e + 1
    (the normaliser's column); see docs/operator.md."""
    b, h, n, d = q_shape
    c = v_shape[-1] + 1
    m = math.prod(blocks)
    return b * h * (4 * n * d * c + 2 * m * m * c * d)


@register_flop_formula(torch.ops.mhla_gen.mhla)
def _mhla_flops(q_shape, k_shape, v_shape, grid, blocks, *args, out_shape=None, **kwargs) -> int:
    return mhla_forward_flops(q_shape, v_shape, blocks)


@register_flop_formula(torch.ops.mhla_gen.mhla_backward)
def _mhla_backward_flops(grad_shape, q_shape, k_shape, v_shape, grid, blocks, *args, out_shape=None,
                         **kwargs) -> int:
    """About twice the forward (each GEMM has two gradient GEMMs), plus the GEMM the backward redoes."""
    return 3 * mhla_forward_flops(q_shape, v_shape, blocks)


def _grouped_conv_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation,
                                 transposed, _output_padding, _groups, output_mask, out_shape=None, **kwargs):
    """Each gradient of a convolution (input, weight) has as many multiply-adds as its forward."""
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


flop_registry[torch.ops.aten.convolution_backward] = shape_wrapper(_grouped_conv_backward_flops)


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of everything ``fn()`` runs (forward and, if it calls it, backward)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()
