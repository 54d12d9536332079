"""Stage 1 of converting a pretrained model to MHLA: attention transfer, layer by layer.

The frozen teacher (the pretrained model with its own attention: softmax for DiT and Wan, SANA's global
linear attention for SANA) runs on real training batches. Every converted layer receives **the
teacher's own input to that layer** and learns to reproduce the teacher layer's output; all layers learn
from one teacher forward per batch, and nothing backpropagates through the model (LoLCATs' "attention
transfer", for diffusion transformers).

How, in one forward: MHLA is installed on the layers to convert (so its grid hooks work as in any MHLA
model), and a forward hook on each converted attention module (:class:`TransferHooks`)

1. takes the MHLA output of that call (the *student*, computed from the module's input),
2. computes the teacher's output from the same input (the stock processor on the same module, or on a
   frozen copy of the module when the projections train too),
3. records ``|student - teacher|² / |teacher|²`` (the relative error: layers weigh alike), and
4. returns the teacher's output, detached, so every later layer sees the teacher's activations.

What trains (``trainable``): ``mhla`` the MHLA parameters only (mixing, CPE, gate; the projections stay
the teacher's, so no copy of anything is held), ``mhla+qk`` also ``to_q`` / ``to_k`` of the converted
layers, ``all`` every parameter of the converted attention modules. With trainable projections the
teacher is a frozen copy of each converted attention module (not of the model), made before training.

After training, :func:`finalize` removes the hooks and, for a hybrid model, puts the stock attention
back in the layers chosen to stay softmax (:func:`hardest_layers`: the ``K`` with the largest remaining
error, or the largest end-to-end gain when kept, :func:`end_to_end_errors`), keeping every trained MHLA
layer's weights.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
from torch import nn

from ..bases import base_for_model
from ..integration.install import install_mhla
from ..processors import MHLAProcessor
from ..processors.config import MHLAConfig

TRAINABLE = ("mhla", "mhla+qk", "all")


def relative_error(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``mean((student - teacher)²) / mean(teacher²)`` in fp32 (a scalar; 0 = exact, 1 = as far as 0)."""
    return ratio(*error_terms(student, teacher))


def error_terms(student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean((student - teacher)²), mean(teacher²))`` in fp32: the relative error's numerator and its
    denominator (detached). Kept apart so a data-parallel loss can average the denominator over every
    process's shard before dividing (the error of the whole batch, not a mean of per-shard ratios)."""
    s, t = student.float(), teacher.float()
    return (s - t).square().mean(), t.square().mean().detach()


def ratio(squared_error: torch.Tensor, power: torch.Tensor) -> torch.Tensor:
    return squared_error / power.clamp_min(1e-30)


def relative_errors(terms: list[tuple[torch.Tensor, torch.Tensor]], power_mean=None) -> torch.Tensor:
    """The relative errors ``(len(terms),)`` of :func:`error_terms` pairs, each squared error divided by
    its teacher power after ``power_mean`` (e.g. the mean over data-parallel processes; None: as is)."""
    power = torch.stack([p for _, p in terms])
    return ratio(torch.stack([sq for sq, _ in terms]), power if power_mean is None else power_mean(power))


def converted_layers(transformer: nn.Module) -> dict[int, nn.Module]:
    """``{layer index: attention module}`` of the self-attention layers that run MHLA."""
    layers = base_for_model(transformer).processor.self_attention(transformer)
    return {i: attn for i, attn in enumerate(layers) if isinstance(attn.processor, MHLAProcessor)}


class TransferHooks:
    """Forward hooks that make every MHLA layer of ``transformer`` a student of the stock attention it
    replaced (see the module docstring). ``terms`` holds each layer's relative error of the last forward as
    its two :func:`error_terms`, the squared error differentiable in the student's parameters.

    Args:
        transformer: a model with MHLA installed on the layers to convert.
        trainable: ``mhla``, ``mhla+qk`` or ``all`` (the latter two keep a frozen copy of each converted
            attention module as its teacher).
    """

    def __init__(self, transformer: nn.Module, trainable: str = "mhla"):
        if trainable not in TRAINABLE:
            raise ValueError(f"trainable must be one of {TRAINABLE}, got {trainable!r}")
        self.layers = converted_layers(transformer)
        if not self.layers:
            raise ValueError("no MHLA layers to train: install MHLA on the layers to convert first")
        stock = base_for_model(transformer).processor.stock_processor
        self.teachers: dict[int, nn.Module | object] = {}
        for index, attn in self.layers.items():
            if trainable == "mhla":  # same projections: the stock processor on the same module
                self.teachers[index] = stock()
            else:  # the projections train: a frozen copy of the module, with the stock processor
                teacher = copy.deepcopy(attn).requires_grad_(False)
                teacher.set_processor(stock())
                self.teachers[index] = teacher
        self.trainable = trainable
        self.stock = stock()
        self.student_layers: set[int] | None = None  # end-to-end mode (see converted)
        self.terms: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # error_terms of the last forward
        self.handles = [
            attn.register_forward_hook(self._hook(i), with_kwargs=True) for i, attn in self.layers.items()
        ]

    def _hook(self, index: int):
        def hook(attn, args, kwargs, student):
            if self.student_layers is not None:  # the converted model itself: no teacher in the path
                if index in self.student_layers:
                    return None
                with torch.no_grad():  # what finalize puts back: the teacher's own layer
                    return self.teacher_output(index, attn, args, kwargs)
            with torch.no_grad():
                teacher_out = self.teacher_output(index, attn, args, kwargs)
            self.terms[index] = error_terms(student, teacher_out)
            return teacher_out.detach()

        return hook

    @contextlib.contextmanager
    def converted(self, mhla_layers=None):
        """Within: the converted model itself, no teacher in the path and no error recorded: MHLA in
        ``mhla_layers`` (default: every converted layer), the teacher's own attention in the others (what
        :func:`finalize` makes of the rest)."""
        self.student_layers = set(self.layers if mhla_layers is None else mhla_layers)
        try:
            yield
        finally:
            self.student_layers = None

    def teacher_output(self, index: int, attn: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        teacher = self.teachers[index]
        if isinstance(teacher, nn.Module):
            teacher.to(attn.to_q.weight.device)  # a no-op after the first call
            return teacher.forward(*args, **kwargs)  # .forward: no hooks of its own
        return teacher(attn, *args, **kwargs)

    def parameters(self) -> list[nn.Parameter]:
        """What trains: the MHLA parameters of the converted layers, plus their q/k projections
        (``mhla+qk``) or every parameter of their attention modules (``all``)."""
        params: dict[int, nn.Parameter] = {}
        for attn in self.layers.values():
            if self.trainable == "all":
                modules = [attn]
            elif self.trainable == "mhla+qk":
                modules = [attn.processor, attn.to_q, attn.to_k]
            else:
                modules = [attn.processor]
            for module in modules:
                params.update({id(p): p for p in module.parameters()})
        return list(params.values())

    def pop_errors(self) -> dict[int, torch.Tensor]:
        """Each layer's relative error of the last forward (cleared: the next forward fills them again)."""
        return {i: ratio(*terms) for i, terms in self.pop_terms().items()}

    def pop_terms(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's :func:`error_terms` of the last forward (cleared like :meth:`pop_errors`)."""
        terms, self.terms = self.terms, {}
        return terms

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.teachers = [], {}


@torch.no_grad()
def end_to_end_errors(transformer: nn.Module, hooks: TransferHooks, batches: list[dict],
                      chosen: list[int] | None = None, each: bool = True) -> dict:
    """What the converted model's output misses of the teacher's, on ``batches`` of model inputs: the
    relative error of the whole model's output with every converted layer running MHLA (``all_mhla``),
    with each layer ``i`` alone put back to stock attention (``keep_softmax[i]``: what :func:`finalize`
    makes of a hybrid with ``softmax_layers=[i]``) and, if given, with the ``chosen`` layers put back
    (``chosen``); ``each=False`` skips the per-layer ones. The teacher's output is the hooked forward's
    (every layer returns the teacher's)."""
    def output(inputs):
        out = transformer(**inputs, return_dict=False)[0]
        hooks.pop_errors()
        return out

    teacher = [output(inputs) for inputs in batches]
    layers = sorted(hooks.layers)

    def error(softmax: list[int]) -> float:
        with hooks.converted([j for j in layers if j not in softmax]):
            return float(sum(relative_error(output(x), t) for x, t in zip(batches, teacher)) / len(batches))

    result = {"all_mhla": error([]), "keep_softmax": {i: error([i]) for i in layers} if each else {}}
    if chosen is not None:
        result["chosen"] = error(chosen)
    return result


def hardest_layers(errors: dict[int, float], k: int) -> list[int]:
    """The ``k`` layers whose error is largest (kept as softmax in a hybrid model), sorted."""
    if not 0 <= k < len(errors):
        raise ValueError(f"K={k} must leave at least one of the {len(errors)} converted layers as MHLA")
    return sorted(sorted(errors, key=lambda i: (-errors[i], i))[:k])


def finalize(transformer: nn.Module, softmax_layers: list[int], teachers: dict | None = None) -> nn.Module:
    """The converted model: MHLA on every converted layer except ``softmax_layers``, each kept layer with
    its trained MHLA weights; the MHLA config records the layers. A layer put back to softmax is the
    teacher's layer: stock attention, and, where stage 1 trained its projections (``TransferHooks``
    ``teachers`` holding frozen module copies: ``trainable=mhla+qk|all``), the teacher's weights again."""
    trained = {i: attn.processor.state_dict() for i, attn in converted_layers(transformer).items()}
    kept = [i for i in trained if i not in softmax_layers]
    cfg: MHLAConfig = transformer.mhla_config
    install_mhla(transformer, dataclasses.replace(cfg, layers=cfg.layers if kept == list(trained) else kept))
    layers = base_for_model(transformer).processor.self_attention(transformer)
    for i in kept:
        layers[i].processor.load_state_dict(trained[i])
    for i in softmax_layers:
        teacher = (teachers or {}).get(i)
        if isinstance(teacher, nn.Module):  # its keys: the projections and norms (stock processors hold none)
            layers[i].load_state_dict(teacher.state_dict())
    return transformer

