"""Floating-point operation counts of MHLA models with torch's ``FlopCounterMode``.

FlopCounterMode counts the matmul-like ATen ops (GEMMs, convolutions, attention). Two registrations make
it count MHLA models right: the registered MHLA op (``mhla_gen::mhla`` and its backward), which it does
not know, and the backward of a *grouped* convolution, whose stock formula ignores ``groups`` in the
weight gradient (it counts SANA's depthwise convolutions and MHLA's CPE as dense ones). Counts are FLOPs
(2 per multiply-add); elementwise work is not counted. Works on the ``meta`` device (shapes only).

Two uses of the counts for training budgets (the studies compare arms at equal compute with them):

* :func:`step_flops`: one forward and one training step (forward and backward) of a model on given inputs
  (:func:`mhla_gen.train.dit_flops.train_flops_per_image`: per image of a DiT run config);
* :class:`Conversion`: the compute behind a converted model (its teacher's training, stage 1, stage 2),
  read at equal total compute or with the teacher as a sunk cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    conv_flop_count,
    flop_registry,
    register_flop_formula,
    shape_wrapper,
)

from ..ops import mhla as _mhla_op_module  # noqa: F401 - registers torch.ops.mhla_gen.*


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


def step_flops(model: torch.nn.Module, inputs: dict) -> dict[str, float]:
    """``{"forward", "train"}`` FLOPs of ``model(**inputs)``: one forward, and one training step (forward +
    backward of the output's sum). Build the model and the inputs on the ``meta`` device to count without
    memory or weights; every count scales with the batch of ``inputs``."""

    def forward():
        return model(**inputs, return_dict=False)[0]

    count = count_flops(forward)
    with torch.enable_grad():  # also from an evaluation under no_grad
        train = count_flops(lambda: forward().sum().backward())
    return {"forward": float(count), "train": float(train)}


@dataclass(frozen=True)
class Conversion:
    """The training compute (FLOPs) behind a converted model after ``stage2_steps`` steps of stage 2.

    ``teacher``: its teacher's training; ``stage1``: stage 1's (its steps, the teacher's forward in each
    included); ``stage2_step``: one stage-2 step (batch x
    :func:`~mhla_gen.train.dit_flops.train_flops_per_image`). A model
    trained from scratch has no teacher and no stage 1: ``Conversion(stage2_step=...)``."""

    teacher: float = 0.0
    stage1: float = 0.0
    stage2_step: float = 0.0

    @classmethod
    def of_point(cls, record: dict) -> Conversion:
        """From an evaluation point of :mod:`studies.experiments`: ``flops_per_image`` x ``batch`` a
        step, stage 1's ``flops`` (``record["stage1"]``) and ``teacher_flops`` (0 where absent)."""
        return cls(float(record.get("teacher_flops", 0.0)), float(record.get("stage1", {}).get("flops", 0.0)),
                   float(record["flops_per_image"]) * record["batch"])

    def total(self, stage2_steps: int) -> float:
        """Every FLOP that made the model: teacher, stage 1, stage 2 (equal total compute)."""
        return self.teacher + self.stage1 + stage2_steps * self.stage2_step

    def after_teacher(self, stage2_steps: int) -> float:
        """The compute spent on the conversion alone: the teacher a sunk cost (a user who has it)."""
        return self.stage1 + stage2_steps * self.stage2_step

    def scratch_steps(self, stage2_steps: int, scratch_step: float, sunk_teacher: bool = False) -> float:
        """The steps a from-scratch run of ``scratch_step`` FLOPs a step trains for the same compute
        (``sunk_teacher``: the same compute as the conversion alone)."""
        spent = self.after_teacher(stage2_steps) if sunk_teacher else self.total(stage2_steps)
        return spent / scratch_step
