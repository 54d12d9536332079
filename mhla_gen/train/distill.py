"""Distillation terms against a frozen teacher, for the second stage of a conversion (LinFusion / CLEAR).

With ``train.distill.output_weight`` / ``attention_weight`` > 0 the task's loss gains

* an **output** term: the relative MSE between the model's output and the frozen teacher's output on the
  same noised input, and
* an **attention** term: the mean over the model's MHLA layers of the relative MSE between that layer's
  output and the teacher's same layer's output (each computed from its own model's activations).

The teacher runs once per micro-batch, without gradients; forward hooks collect both models'
self-attention outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from ..bases import base_for_model
from ..processors import MHLAProcessor
from .transfer import error_terms, relative_errors


class _LayerOutputs:
    """Forward hooks keeping the output of the chosen self-attention layers of ``model``."""

    def __init__(self, model: nn.Module, indices: list[int]):
        layers = base_for_model(model).processor.self_attention(model)
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_hook(self._keep(i)) for i in indices]

    def _keep(self, index: int):
        def hook(module, args, output):
            self.outputs[index] = output

        return hook

    def pop(self) -> dict[int, torch.Tensor]:
        outputs, self.outputs = self.outputs, {}
        return outputs


class Distiller:
    """``distiller(student_output, inputs)`` -> the weighted distillation terms of one micro-batch.

    Args:
        teacher: the frozen teacher transformer (same family and layer count as ``student``).
        student: the transformer being trained (hooks go on its MHLA layers).
        output_weight, attention_weight: the weights of the two terms.
        power_mean: averages the teachers' powers (each relative error's denominator) over data-parallel
            processes (e.g. ``accelerator.reduce(t, "mean")``), so each error is the whole batch's and N
            processes train as one with the same global batch; the default keeps this process's own.
    """

    def __init__(self, teacher: nn.Module, student: nn.Module, output_weight: float, attention_weight: float,
                 power_mean=None):
        self.teacher = teacher.eval().requires_grad_(False)
        self.output_weight, self.attention_weight = output_weight, attention_weight
        self.power_mean = power_mean
        layers = base_for_model(student).processor.self_attention(student)
        mhla = [i for i, attn in enumerate(layers) if isinstance(attn.processor, MHLAProcessor)]
        if attention_weight > 0 and not mhla:
            raise ValueError("train.distill.attention_weight > 0 but the model has no MHLA layers")
        self.student_layers = _LayerOutputs(student, mhla if attention_weight > 0 else [])
        self.teacher_layers = _LayerOutputs(teacher, mhla if attention_weight > 0 else [])

    def __call__(self, student_output: torch.Tensor, inputs: dict) -> torch.Tensor:
        with torch.no_grad():
            teacher_output = self.teacher(**inputs, return_dict=False)[0]
        student, teacher = self.student_layers.pop(), self.teacher_layers.pop()
        output = [error_terms(student_output, teacher_output)] if self.output_weight > 0 else []
        layers = [error_terms(student[i], teacher[i]) for i in student] if self.attention_weight > 0 else []
        total = student_output.new_zeros((), dtype=torch.float32)
        if not output + layers:
            return total
        errors = relative_errors(output + layers, self.power_mean)
        if output:
            total = total + self.output_weight * errors[0]
        if layers:
            total = total + self.attention_weight * errors[len(output):].mean()
        return total
