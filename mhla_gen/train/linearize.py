"""Stage 1 of a conversion as a training run: ``scripts/linearize.py`` (attention transfer, then hybrid
layers chosen by their remaining error).

:class:`TransferTask` wraps the training task of the base model (DiT, SANA or Wan: its data, noising and
conditioning) and replaces its objective by :mod:`mhla_gen.train.transfer`'s: every MHLA layer learns to
reproduce the frozen teacher layer's output from the teacher's own input. It runs through the same
:func:`~mhla_gen.train.loop.train` as every training script, so it checkpoints, resumes exactly and writes
``config.yaml`` / ``metrics.jsonl`` the same way. At the end (:meth:`TransferTask.save_final`):

1. each converted layer's relative error on ``transfer.eval_batches`` held-out batches, for the trained
   layers and for the layers at their init, and the end-to-end number beside them: the converted
   model's output error against the teacher's on the same inputs (plain conversion, after stage 1, with
   each layer alone kept softmax, and the final model; :func:`mhla_gen.train.transfer.end_to_end_errors`);
2. ``hybrid.softmax_layers``: ``auto:K`` keeps stock attention in the K layers whose keeping lowers the
   end-to-end error most (``hybrid.rank_by=layer_error``: whose own error stays largest); a list keeps
   those layers, null none; :func:`mhla_gen.train.transfer.finalize`;
3. ``final/``: the converted transformer, which ``load_transformer``, the pipelines and the training
   scripts (``model.init_from``) read; its marker records the teacher;
4. ``output_dir/transfer.json`` (errors, chosen layers, cost: steps, wall time, FLOPs in teacher-forward
   equivalents) and ``output_dir/transfer_errors.png``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from ..bases import Base
from ..integration.install import uninstall_mhla
from ..metrics.flops import count_flops
from ..outputs.folders import file_record, input_record
from .attention import attention_mhla_config, saved_mhla
from .config import ConfigError, TrainConfig
from .io import atomic_write_text, read_jsonl
from .loop import processes_mean
from .randomness import StepRandom
from .task import TrainTask
from .transfer import (
    TRAINABLE,
    TransferHooks,
    converted_layers,
    end_to_end_errors,
    error_terms,
    finalize,
    hardest_layers,
    relative_errors,
)

logger = logging.getLogger(__name__)

REPORT = "transfer.json"
REPORT_KIND = "transfer_report"


@dataclass
class TransferConfig:
    """What stage 1 trains and how it is measured.

    * ``trainable``: ``all`` (default) every parameter of the converted attention modules; ``mhla`` the
      mixing, CPE and gate only; ``mhla+qk`` also the q/k projections. On the digits ``all`` gives a head
      start that survives a quarter of stage 2 and ``mhla`` none (docs/results/evidence.md).
    * ``eval_batches``: held-out batches that measure each layer's error and the end-to-end error.
    * ``output_weight``: the weight of the end-to-end term (the converted model's output error against
      the teacher's, on the same batch) beside the mean per-layer error; 0 = attention transfer only.
    """

    trainable: str = "all"
    eval_batches: int = 4
    output_weight: float = 0.0

    def __post_init__(self):
        if self.trainable not in TRAINABLE:
            raise ValueError(f"transfer.trainable must be one of {TRAINABLE}, got {self.trainable!r}")
        if not 0 <= self.output_weight < float("inf"):
            raise ValueError(f"transfer.output_weight must be a finite number >= 0, got {self.output_weight}")
        if self.eval_batches < 1:
            raise ValueError(f"transfer.eval_batches must be >= 1, got {self.eval_batches}")


@dataclass
class HybridConfig:
    """``softmax_layers``: null (every converted layer stays MHLA), ``auto:K`` (K converted layers keep the
    teacher's attention), or a list of layer indices. ``rank_by`` orders layers for ``auto:K``:
    ``end_to_end`` (by how much the converted model's output error against the teacher's drops when that
    layer alone stays softmax, on held-out inputs) or ``layer_error`` (by the layer's own stage-1 error,
    the cheaper proxy)."""

    softmax_layers: Any = None
    rank_by: str = "end_to_end"

    def __post_init__(self):
        if self.rank_by not in ("end_to_end", "layer_error"):
            raise ValueError(f"hybrid.rank_by must be end_to_end or layer_error, got {self.rank_by!r}")


def _stage1_train() -> TrainConfig:
    return TrainConfig(max_steps=1000, learning_rate=1e-3, ema_decay=0.0, checkpoint_every=500)


@dataclass
class Stage1Sections:
    """What a stage-1 config adds to (and changes in) its base model's training config."""

    train: TrainConfig = field(default_factory=_stage1_train)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)


@functools.cache
def stage1_schema(base: Base) -> type:
    """The stage-1 config of a base: its run config (``base.run_config``) plus :class:`Stage1Sections`
    (whose ``train`` defaults win), with ``output_dir`` ``runs/linearize_<name>``."""
    run_config = base.run_config.load()
    name = f"{run_config.__name__.removesuffix('RunConfig')}LinearizeConfig"
    output_dir = ("output_dir", str, field(default=f"runs/linearize_{base.name}"))
    return dataclasses.make_dataclass(name, [output_dir], bases=(Stage1Sections, run_config))


def parse_softmax_layers(value, converted: list[int]) -> tuple[int | None, list[int]]:
    """``hybrid.softmax_layers`` -> ``(K, [])`` for ``auto:K`` or ``(None, layers)`` for a list; checked
    against the ``converted`` layers (at least one must stay MHLA)."""
    if value is None:
        return None, []
    if not isinstance(value, (str, list, tuple)) or (
        not isinstance(value, str) and not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        raise ConfigError(
            f"hybrid.softmax_layers must be null, auto:K or a list of layer indices (integers), got "
            f"{value!r}"
        )
    if isinstance(value, str):
        head, _, k = value.partition(":")
        if head != "auto" or not k.strip().isdigit():
            raise ConfigError(
                f"hybrid.softmax_layers must be null, auto:K or a list of layers, got {value!r}"
            )
        if int(k) >= len(converted):
            raise ConfigError(
                f"hybrid.softmax_layers={value}: K={int(k)} must leave at least one of the {len(converted)} "
                f"converted layers as MHLA"
            )
        return int(k), []
    layers = sorted({int(i) for i in value})
    if not set(layers) <= set(converted) or len(layers) >= len(converted):
        raise ConfigError(
            f"hybrid.softmax_layers={list(value)} must be converted layers ({converted}) and leave at "
            f"least one as MHLA"
        )
    return None, layers


class TransferTask(TrainTask):
    """Stage 1 on top of a base task (``DiTTask``, ``SanaTask``, ``WanTask``); see the module docstring."""

    name = "linearize"

    def __init__(self, cfg, inner: TrainTask):
        super().__init__(cfg)
        self.inner = inner  # the base model's own task: data, noising, conditioning
        self.collate_fn = inner.collate_fn
        self.fsdp_units, self.fsdp_shared = inner.fsdp_units, inner.fsdp_shared  # the model's FSDP2 units
        self.hooks: TransferHooks | None = None
        self.dataset: Dataset | None = None
        self.device = torch.device("cpu")
        self.power_mean = None  # set by setup(): the mean over the processes whose shards make one batch

    # ------------------------------------------------------------------------------------- checks
    def teacher(self) -> str:
        """Where the frozen teacher comes from: a local folder resolved and absolute, or a hub id (recorded
        in ``final/``'s marker with its fingerprint, :func:`~mhla_gen.outputs.folders.input_record`)."""
        source = str(self.inner.conversion_teacher()[0])
        local = Path(source).expanduser()
        return str(local.resolve()) if local.exists() else source

    def inputs(self) -> dict[str, str | None]:
        return self.inner.inputs()

    def written_inside(self) -> tuple[str, ...]:
        return self.inner.written_inside()

    def check_data(self) -> None:
        self.inner.check_data()

    def validate(self) -> None:
        """The base task's checks, a teacher with its own (stock) attention, an MHLA student, and the
        hybrid and stage-1 settings; all before any work."""
        cfg = self.cfg
        teacher, folder = self.inner.conversion_teacher()
        if saved_mhla(folder) is not None:
            raise ConfigError(
                f"the teacher {str(teacher)!r} already runs MHLA; stage 1 needs a model with its own "
                f"attention (softmax for DiT and Wan, SANA's linear attention)"
            )
        if cfg.model.attention == "softmax":
            raise ConfigError("model.attention=softmax leaves nothing to convert; use mhla (or linear)")
        if cfg.train.trainable != "all" or cfg.train.distill.enabled:
            raise ConfigError(
                "stage 1 trains what transfer.trainable says, with its own objective: leave train.trainable "
                "and train.distill at their defaults"
            )
        self.inner.validate()
        parse_softmax_layers(cfg.hybrid.softmax_layers, self.converted_indices())
        chunks = attention_mhla_config(*self.inner.attention()).chunk_frames
        if chunks is not None and cfg.hybrid.softmax_layers is not None:
            raise ConfigError(f"hybrid.softmax_layers={cfg.hybrid.softmax_layers!r} with mhla.chunk_frames="
                              f"{chunks}: a softmax layer would see later chunks; leave "
                              f"hybrid.softmax_layers null for a block-causal student")

    def run_config(self):
        return self.inner.run_config()

    def converted_indices(self) -> list[int]:
        """The layers stage 1 converts: ``mhla.layers`` (all when null) of the base model's depth."""
        mhla = attention_mhla_config(*self.inner.attention())
        if mhla.layers is not None:
            return sorted(mhla.layers)
        return list(range(self.inner.depth()))

    def count_items(self) -> int | None:
        return self.inner.count_items()

    def signature(self) -> dict:
        return {**self.inner.signature(), "transfer": self.cfg.transfer.trainable}

    # -------------------------------------------------------------------------------------- model
    def build_transformer(self) -> nn.Module:
        transformer = self.inner.build_transformer()
        self.hooks = TransferHooks(transformer, self.cfg.transfer.trainable)
        return transformer

    def trainable_parameters(self, transformer: nn.Module) -> list[nn.Parameter]:
        """What ``transfer.trainable`` trains, in the model's parameter order (the loop's EMA pairs its
        shadows with ``transformer.parameters()`` that require grad, in that order)."""
        keep = {id(p) for p in self.hooks.parameters()}
        for p in transformer.parameters():
            p.requires_grad_(id(p) in keep)
        return [p for p in transformer.parameters() if id(p) in keep]

    def setup(self, accelerator) -> None:
        self.device = accelerator.device
        self.power_mean = processes_mean(accelerator)
        self.inner.setup(accelerator)

    def build_dataset(self, accelerator) -> Dataset:
        self.dataset = self.inner.build_dataset(accelerator)
        return self.dataset

    def batch_sampler(self, dataset: Dataset, batch_size: int, processes: int, seed: int):
        return self.inner.batch_sampler(dataset, batch_size, processes, seed)  # e.g. aspect-ratio buckets

    def loss(self, model: nn.Module, batch: dict, rnd: StepRandom) -> torch.Tensor:
        inputs, _ = self.inner.model_inputs(batch, rnd)
        return self.objective(model, inputs, whole_batch=True)

    def objective(self, model: nn.Module, inputs: dict, whole_batch: bool = False) -> torch.Tensor:
        """The mean over converted layers of each layer's relative error against the teacher layer, plus
        ``transfer.output_weight`` times the end-to-end error: a second forward of the converted model
        itself (MHLA in the path, so each layer also learns what the layers after it make of its error)
        against the first forward's output, which is the teacher's (every hooked layer returns it).

        With ``whole_batch`` (training: every process calls it) each relative error divides by the
        teacher's power averaged over every process's shard, so data-parallel processes (whose gradients
        DDP averages) train on the error of the whole batch: the same run as one process with the same
        global batch."""
        teacher_out = model(**inputs, return_dict=False)[0]
        terms = list(self.hooks.pop_terms().values())  # (squared error, teacher power) per layer
        layers = len(terms)
        if self.cfg.transfer.output_weight:
            with self.hooks.converted():
                student_out = model(**inputs, return_dict=False)[0]
            terms.append(error_terms(student_out, teacher_out.detach()))
        errors = relative_errors(terms, self.power_mean if whole_batch else None)
        loss = errors[:layers].mean()
        if self.cfg.transfer.output_weight:
            loss = loss + self.cfg.transfer.output_weight * errors[layers]
        return loss

    def sample_images(self, transformer: nn.Module) -> tuple[list, int]:
        if self.hooks is not None and self.hooks.handles:  # hooked: the model computes the teacher
            return [], 1
        return self.inner.sample_images(transformer)

    # ------------------------------------------------------------------------------------ the end
    def save_final(self, transformer: nn.Module, folder: Path) -> None:
        """Errors before / after, the hybrid choice, the converted model in ``folder``, the report."""
        after = self.layer_errors(transformer, self.hooks)
        cost = self.cost(transformer)
        before, end_before = self.initial_errors()
        k, fixed = parse_softmax_layers(self.cfg.hybrid.softmax_layers, sorted(after))
        end = end_to_end_errors(transformer, self.hooks, self.eval_inputs())
        gains = {i: end["all_mhla"] - e for i, e in end["keep_softmax"].items()}
        ranking = gains if self.cfg.hybrid.rank_by == "end_to_end" else after
        softmax = hardest_layers(ranking, k) if k is not None else fixed
        chosen = end_to_end_errors(transformer, self.hooks, self.eval_inputs(), softmax, each=False)["chosen"]
        teachers = dict(self.hooks.teachers)
        self.hooks.remove()
        finalize(transformer, softmax, teachers)
        self.inner.save_final(transformer, folder)
        self.report = {
            "teacher": self.teacher(), "trainable": self.cfg.transfer.trainable,
            "output_weight": self.cfg.transfer.output_weight,
            "hybrid": self.cfg.hybrid.softmax_layers, "softmax_layers": softmax,
            "mhla_layers": sorted(converted_layers(transformer)),
            "errors_before": {str(i): before[i] for i in sorted(before)},
            "errors_after": {str(i): after[i] for i in sorted(after)}, **cost,
            "end_to_end_before": end_before, "end_to_end_after": end["all_mhla"], "end_to_end_final": chosen,
            "end_to_end_keep_softmax": {str(i): e for i, e in end["keep_softmax"].items()},
            "rank_by": self.cfg.hybrid.rank_by,
        }
        out = Path(self.cfg.output_dir)
        atomic_write_text(out / REPORT, json.dumps({**self.report, **file_record(REPORT_KIND)}, indent=1))
        plot_errors(before, after, softmax, out / "transfer_errors.png")

    def model_record(self) -> dict:
        return {**self.inner.model_record(), "teacher": self.teacher(),
                "teacher_record": input_record(self.teacher()), "stage": "attention transfer"}

    def finish(self, transformer: nn.Module, accelerator) -> dict:
        r = self.report
        summary = {
            "transfer_error_before": float(np.mean(list(r["errors_before"].values()))),
            "transfer_error_after": float(np.mean(list(r["errors_after"].values()))),
            "end_to_end_before": r["end_to_end_before"], "end_to_end_final": r["end_to_end_final"],
            "teacher_forward_equivalents": r["teacher_forward_equivalents"],
        }
        return {**summary, **self.inner.finish(transformer, accelerator)}

    # -------------------------------------------------------------------------------- measurements
    def eval_inputs(self) -> list[dict]:
        """``transfer.eval_batches`` fixed batches of model inputs, noised with a seed of their own: the
        same for every measurement of the run. Images: the data source's held-out set when it has one
        (``DiTSource.held_out``: the shapes), else the dataset's first items (the noise and timesteps are
        still ones training never draws)."""
        size = self.cfg.train.global_batch_size // self.cfg.train.gradient_accumulation_steps
        source = getattr(self.inner, "source", None)  # a DiT's data source (train/dit_sources.py)
        held_out = source.held_out() if hasattr(source, "held_out") else None
        dataset = held_out if held_out is not None else self.dataset
        # with buckets (items of several sizes), each batch holds one bucket: the sampler's first batches
        buckets = self.batch_sampler(dataset, size, 1, self.cfg.seed + 7919) if held_out is None else None
        indices = buckets.global_batches() if buckets is not None else None
        batches = []
        for i in range(self.cfg.transfer.eval_batches):
            chosen = indices[i % len(indices)] if indices else [(i * size + j) for j in range(size)]
            items = [dataset[k % len(dataset)] for k in chosen]
            batch = (self.collate_fn or default_collate)(items)
            batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            rnd = StepRandom(self.cfg.seed + 7919, i, size, device=self.device)
            batches.append(self.inner.model_inputs(batch, rnd)[0])
        return batches

    @torch.no_grad()
    def layer_errors(self, transformer: nn.Module, hooks: TransferHooks) -> dict[int, float]:
        """Each converted layer's relative error, averaged over :meth:`eval_inputs`."""
        totals: dict[int, float] = {}
        batches = self.eval_inputs()
        for inputs in batches:
            transformer(**inputs, return_dict=False)
            for i, e in hooks.pop_errors().items():
                totals[i] = totals.get(i, 0.0) + e.item() / len(batches)
        return totals

    def initial_errors(self) -> tuple[dict[int, float], float]:
        """:meth:`layer_errors` of the model stage 1 started from (MHLA at its init) and its end-to-end
        error (the plain conversion's output against the teacher's)."""
        fresh = self.inner.build_transformer().to(self.device).eval()
        hooks = TransferHooks(fresh, "mhla")
        errors = self.layer_errors(fresh, hooks)
        end = end_to_end_errors(fresh, hooks, self.eval_inputs(), each=False)["all_mhla"]
        del fresh
        return errors, end

    def cost(self, transformer: nn.Module) -> dict:
        """Steps and wall time of stage 1 (from ``metrics.jsonl``), and its FLOPs in forwards of the
        teacher on the same batch (counted with :mod:`mhla_gen.metrics.flops`)."""
        inputs = self.eval_inputs()[0]

        def stage1_step():
            self.objective(transformer, inputs).backward()

        step_flops = count_flops(stage1_step)
        transformer.zero_grad(set_to_none=True)
        teacher = self.inner.build_transformer().to(self.device).eval()
        uninstall_mhla(teacher)
        with torch.no_grad():
            teacher_flops = count_flops(lambda: teacher(**inputs, return_dict=False))
        records = [r for r in read_jsonl(Path(self.cfg.output_dir) / "metrics.jsonl") if "steps_per_s" in r]
        seconds, last = 0.0, 0
        for r in records:
            seconds, last = seconds + (r["step"] - last) / r["steps_per_s"], r["step"]
        steps = self.cfg.train.max_steps
        return {
            "steps": steps, "wall_seconds": seconds, "stage1_step_flops": step_flops,
            "teacher_forward_flops": teacher_flops,
            "teacher_forward_equivalents": steps * self.cfg.train.gradient_accumulation_steps
            * step_flops / teacher_flops,
        }


def plot_errors(before: dict[int, float], after: dict[int, float], softmax: list[int], path: Path) -> None:
    """Each converted layer's relative error before and after stage 1 (log scale); the layers kept as
    softmax are marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(after)
    x = np.arange(len(layers))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(layers) + 2), 3.2))
    ax.bar(x - 0.2, [before[i] for i in layers], 0.4, label="at init")
    ax.bar(x + 0.2, [after[i] for i in layers], 0.4, label="after stage 1")
    ax.set_xticks(x, [f"{i}*" if i in softmax else str(i) for i in layers])
    ax.set(yscale="log", xlabel="layer (* = kept as softmax)", ylabel="relative error |s-t|²/|t|²")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
