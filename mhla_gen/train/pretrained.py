"""Fine-tuning the transformer of a pretrained diffusers pipeline: the model side of a captioned run.

:class:`PretrainedConfigs` reads ``model.pretrained`` without weights (the pipeline's ``model_index.json``,
its transformer's and VAE's ``config.json``, or those of the ``model.init_from`` transformer the run starts
from) and checks it against the base record before any work. :class:`PretrainedTask` is everything a task
does with the pretrained model: the transformer it trains (start point, attention, LoRA), the frozen rest
of the pipeline, the teachers, the final folder; :class:`~mhla_gen.train.captioned.CaptionedTask` adds the
data and the objective.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from torch import nn

from ..bases import Base
from ..errors import ConfigError
from ..integration.install import stock_class_name
from ..integration.loading import check_weight_files
from ..integration.lora import is_lora_folder, save_lora_mhla
from ..outputs.folders import input_record
from ..processors.config import MHLAConfig
from .attention import attention_mhla_config, install_attention, load_teacher
from .experts import check_expert, pipeline_with
from .start import StartPoint
from .task import TrainTask, empty_model

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _same_model(a: str, b: str) -> bool:
    """Two model references name the same thing: equal strings, or local paths to the same folder."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return a == b or (pa.exists() and pb.exists() and pa.resolve() == pb.resolve())


def log_teacher(cfg, teacher: str) -> None:
    """Say which distillation teacher a run uses, and warn when one ``model.init_from`` records is not
    ``model.pretrained``."""
    logger.info("distillation teacher: %s", teacher)
    if not cfg.train.distill.teacher and not _same_model(teacher, cfg.model.pretrained):
        logger.warning("distilling from the teacher model.init_from=%s converts (%s), not from "
                       "model.pretrained=%s", cfg.model.init_from, teacher, cfg.model.pretrained)


def pretrained_component_config(model_cfg, cls_name: str, subfolder: str | None) -> dict:
    """``config.json`` of a component of ``model.pretrained`` (``model_index.json`` for the pipeline class)
    read with diffusers' ``load_config`` (no weights); one-line errors naming the setting."""
    pretrained = model_cfg.pretrained
    local = Path(pretrained).expanduser()
    if (local.exists() or pretrained.startswith((".", "/", "~"))) and not local.is_dir():
        raise FileNotFoundError(f"model.pretrained={pretrained!r} is not a folder")
    try:
        return dict(getattr(diffusers, cls_name).load_config(pretrained, subfolder=subfolder,
                                                             revision=model_cfg.revision))
    except OSError as err:
        raise ConfigError(f"model.pretrained={pretrained!r}: {err}") from None


@dataclass(frozen=True)
class PretrainedConfigs:
    """The configs of a run's ``model.pretrained`` pipeline and of the transformer it trains.

    Attributes:
        model: the run's ``model`` section (``pretrained``, ``revision``, ``expert``).
        start: ``model.init_from`` resolved (:class:`StartPoint`).
        base: the record of the base the run trains (its pipeline and transformer classes).
    """

    model: object
    start: StartPoint
    base: Base

    def component(self, cls_name: str, subfolder: str | None) -> dict:
        """``config.json`` (``model_index.json`` for the pipeline) of ``model.pretrained``, no weights."""
        return pretrained_component_config(self.model, cls_name, subfolder)

    def index(self) -> dict:
        """The pipeline's ``model_index.json``."""
        return self.component("DiffusionPipeline", None)

    def check_family(self) -> None:
        """``model.pretrained`` is a pipeline of the base's class, with the ``model.expert`` slot."""
        index, wanted = self.index(), self.base.pipeline_class
        if index.get("_class_name") != wanted:
            raise ConfigError(
                f"model.pretrained={self.model.pretrained!r} is a {index.get('_class_name')} checkpoint, "
                f"not a {wanted} (wrong script for this model?)"
            )
        check_expert(index, self.model.expert, self.model.pretrained)
        local = Path(self.model.pretrained).expanduser()
        for name, entry in index.items():  # a local pipeline's components: a cut weight file in one line
            if isinstance(entry, list) and (local / name).is_dir():
                check_weight_files(local / name, f"model.pretrained={self.model.pretrained!r}")

    def transformer(self) -> dict:
        """The trained transformer's ``config.json``: ``model.init_from``'s, else the checkpoint's."""
        return self.start_config() or self.component(self.base.transformer_class.__name__, self.model.expert)

    def configs(self) -> tuple[dict, dict]:
        """``(transformer config, VAE config)``: :meth:`transformer` and the checkpoint's VAE."""
        index = self.index()
        return self.transformer(), self.component(index["vae"][1], "vae")

    def start_config(self) -> dict | None:
        """``model.init_from``'s ``config.json`` (None when unset): it must be a full transformer folder of
        this model family."""
        if not self.start:
            return None
        ref, folder = self.start.ref, self.start.folder or Path(self.start.ref)
        if is_lora_folder(folder):
            raise ConfigError(f"model.init_from={ref!r} is a LoRA folder; start from a full transformer "
                              f"folder, or from its base with train.trainable=lora")
        if not (folder / "config.json").is_file():
            raise ConfigError(f"model.init_from={ref!r} is not a transformer folder (no config.json)")
        loaded = json.loads((folder / "config.json").read_text())
        name = self.base.transformer_class.__name__
        if stock_class_name(loaded.get("_class_name")) != name:
            raise ConfigError(f"model.init_from={ref!r} is a {loaded.get('_class_name')}, not a {name}")
        return loaded


class PretrainedTask(TrainTask):
    """A task that fine-tunes the transformer of ``model.pretrained`` (or a saved transformer of it,
    ``model.init_from``). Subclasses name their base record (:attr:`base`: the transformer and pipeline
    classes); :class:`~mhla_gen.train.captioned.CaptionedTask` adds the data and the objective."""

    base: Base

    def __init__(self, cfg):
        super().__init__(cfg)
        if not cfg.model.pretrained:
            raise ValueError("model.pretrained is required: a diffusers checkpoint folder or hub id")
        self.frozen = None  # setup(): the pipeline minus its transformer (text encoder, VAE, scheduler)
        self.start = StartPoint.resolve(cfg.model.init_from)
        self.pretrained = PretrainedConfigs(cfg.model, self.start, self.base)

    @property
    def transformer_cls(self) -> type:
        return self.base.transformer_class

    def signature(self) -> dict:
        attention, mhla = self.attention()
        mhla = attention_mhla_config(attention, mhla)
        return {
            "pretrained": self.cfg.model.pretrained,
            "attention": attention,
            "mhla": mhla.to_dict() if mhla is not None else None,
            "lora": self.lora_signature(),
            # likewise None without a start point (the key's name before model.init_from)
            "transformer": self.start.ref,
            "expert": None if self.cfg.model.expert == "transformer" else self.cfg.model.expert,
        }

    def attention(self) -> tuple[str, MHLAConfig]:
        """``(model.attention, mhla)`` this run trains: as configured, or the MHLA that ``model.init_from``
        was saved with (``model.init_attention=saved``, see :meth:`StartPoint.attention`)."""
        m = self.cfg.model
        return self.start.attention(m.attention, self.cfg.mhla, m.init_attention)

    def run_config(self):
        """The config with the attention this run trains and the distillation teacher it uses (what
        ``config.yaml`` records)."""
        attention, mhla = self.attention()
        model = dataclasses.replace(self.cfg.model, attention=attention)
        train = self.cfg.train
        if train.distill.enabled:
            train = dataclasses.replace(train, distill=dataclasses.replace(train.distill,
                                                                           teacher=self.distill_source()))
        return dataclasses.replace(self.cfg, model=model, mhla=mhla, train=train)

    def distill_source(self) -> str:
        """``train.distill.teacher``, else what ``model.init_from`` converts (checked), else the base."""
        return self.cfg.train.distill.teacher or self.start.teacher() or self.cfg.model.pretrained

    def distill_teacher(self) -> nn.Module:
        """``train.distill.teacher``, else ``model.pretrained``'s own transformer."""
        return load_teacher(self.transformer_cls, self.distill_source(), self.cfg.model.expert)

    def conversion_teacher(self) -> tuple[str, Path | None]:
        """``(reference, local transformer folder or None)`` of the model stage 1 converts: the start
        point, else ``model.pretrained``'s own transformer."""
        if self.start:
            return self.start.ref, self.start.folder
        folder = Path(self.cfg.model.pretrained) / self.cfg.model.expert
        return self.cfg.model.pretrained, folder if folder.is_dir() else None

    def model_configs(self) -> tuple[dict, dict]:
        """``(transformer config, VAE config)`` of the model trained (``model.init_from``'s or the
        checkpoint's transformer) and of the checkpoint's VAE: no weights."""
        return self.pretrained.configs()

    def depth(self) -> int:
        """Transformer blocks of the model trained (``model.init_from``'s or the checkpoint's)."""
        return self.pretrained.transformer()["num_layers"]

    def architecture(self) -> nn.Module:
        return empty_model(self.transformer_cls, self.pretrained.transformer())

    def build_transformer(self) -> nn.Module:
        m = self.cfg.model
        if self.start:  # a saved transformer to start from (e.g. a stage-1 folder)
            transformer = self.start.load(self.transformer_cls, *self.attention(), m.init_attention)
        else:
            transformer = self.transformer_cls.from_pretrained(m.pretrained, subfolder=m.expert,
                                                               revision=m.revision, dtype=torch.float32)
            install_attention(transformer, m.attention, self.cfg.mhla)
        return self.with_lora(transformer)

    def setup(self, accelerator) -> None:
        """The checkpoint's pipeline minus the transformer (tokenizer, text encoder, VAE, scheduler),
        frozen, in ``model.dtype`` on the device: it encodes the data, gives its scheduler to the objective
        and assembles the sampling pipeline."""
        m = self.cfg.model
        pipe = getattr(diffusers, self.base.pipeline_class).from_pretrained(
            m.pretrained,
            **{m.expert: None},  # a Wan2.2 expert's run keeps the other one (samples)
            revision=m.revision,
            dtype=DTYPES[m.dtype],
        )
        pipe.set_progress_bar_config(disable=True)
        self.frozen = pipe.to(accelerator.device)

    def pipeline(self, transformer, progress: bool = False):
        """The frozen pipeline with ``transformer`` in the ``model.expert`` slot (after :meth:`setup`)."""
        return pipeline_with(self.frozen, self.cfg.model.expert, transformer, progress)

    def teacher_pipeline(self, device) -> object:
        """The frozen pipeline with ``model.pretrained``'s own transformer (its ``model.expert``): what
        ``data.source=teacher`` samples."""
        m = self.cfg.model
        teacher = self.transformer_cls.from_pretrained(m.pretrained, subfolder=m.expert, revision=m.revision,
                                                       dtype=getattr(torch, m.dtype))
        return self.pipeline(teacher.to(device))

    def save_final(self, transformer: nn.Module, folder: Path) -> None:
        """LoRA runs: adapter + MHLA parameters + the pretrained checkpoint's name (``load_transformer``
        rebuilds the model from the three); otherwise the whole transformer (``save_pretrained``)."""
        if self.cfg.train.trainable != "lora":
            return super().save_final(transformer, folder)
        m = self.cfg.model
        save_lora_mhla(transformer, folder, m.pretrained, subfolder=m.expert, revision=m.revision,
                       base_id=self.cfg.share.base_model)  # base_id: the hub id its manifest names

    def model_record(self) -> dict:
        """LoRA runs: the local base, resolved and fingerprinted, for ``final/``'s marker (never shared)."""
        lora = self.cfg.train.trainable == "lora"
        return {"base_record": input_record(self.cfg.model.pretrained)} if lora else {}
