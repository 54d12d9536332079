"""Run configuration: dataclass defaults -> YAML (only deviations) -> CLI dotlist, merged strictly.

Every training script has one top-level dataclass (``DiTRunConfig``, ``SanaRunConfig``, ``WanRunConfig``)
built from the shared sections below. :func:`load_config` merges with OmegaConf in struct mode, so an
unknown or misspelt key anywhere (file or command line) is an error that names the key, and a value of
the wrong type is an error that names the field. The defaults are the papers' settings; the YAML files
in ``configs/`` list what a run changes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..bases import BASES
from ..data.buckets import check_buckets
from ..errors import ConfigError  # noqa: F401 - re-exported: raised by load_config and the tasks
from ..integration.lora import LORA_TARGET_MODULES, check_lora_settings
from ..processors.config import MHLAConfig

ATTENTION_TYPES = ("softmax", "linear", "mhla")
# diffusers.optimization.SchedulerType names train.lr_scheduler takes (piecewise_constant wants step rules
# counted in scheduler calls, which Accelerate multiplies by the process count: not offered)
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")
TRACKERS = ("tensorboard", "wandb", "trackio", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab", "aim")
# train.optimizer values (mhla_gen.train.optimizers: the library each comes from, the extra that installs it)
OPTIMIZERS = ("adamw", "adamw8bit", "prodigy", "adafactor")
# flow.loss_weighting values: diffusers.training_utils.compute_loss_weighting_for_sd3's schemes
FLOW_LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")
FRAME_SAMPLINGS = ("first", "uniform", "random")  # data.frame_sampling (mhla_gen.data.videos.frame_indices)
# settings whose default changed, with the old default and the date: a resumed run whose config.yaml
# records the old value keeps it unless the setting is given again (mhla_gen.train.run_start.follow_recorded)
CHANGED_DEFAULTS = {"train.max_grad_norm": (0.0, "2026-11-28")}


T = TypeVar("T")


@dataclass
class DistillConfig:
    """Distillation terms against a frozen teacher, added to the task's loss (LinFusion / CLEAR style); off
    by default. ``teacher``: its transformer (folder or hub id); default: the model the run converts (the
    teacher a stage-1 ``model.init_from`` records, or ``model.init_from`` itself when it is a stock model;
    SANA / Wan otherwise: ``model.pretrained``'s transformer)."""

    output_weight: float = 0.0  # x relative MSE between the model's and the teacher's outputs
    attention_weight: float = 0.0  # x mean relative MSE of every MHLA layer's output vs the teacher layer's
    teacher: str | None = None

    def __post_init__(self):
        for name in ("output_weight", "attention_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.distill.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return self.output_weight > 0 or self.attention_weight > 0


@dataclass
class TrainConfig:
    """Optimisation and checkpointing, shared by every script.

    ``global_batch_size`` is the batch of one optimizer step over all processes and accumulation steps,
    so the same config trains the same way on 1 or 8 GPUs (per-device batch = global / (procs * accum)).
    """

    max_steps: int = 400_000
    global_batch_size: int = 256
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    lr_warmup_steps: int = 0
    # diffusers.optimization.get_scheduler: constant | constant_with_warmup | linear | cosine |
    # cosine_with_restarts | polynomial; the decaying ones reach their end at train.max_steps
    lr_scheduler: str = "constant_with_warmup"
    lr_num_cycles: int = 1  # cosine_with_restarts: hard restarts
    lr_power: float = 1.0  # polynomial: the decay's power
    # clip the gradient norm at this value (diffusers' training examples: 1.0); 0 or null = no clipping
    # (the DiT paper's configs set 0); the norm is logged either way. The default was 0 before 2026-11-28
    max_grad_norm: float | None = 1.0
    # adamw (torch) | adamw8bit (bitsandbytes, extra [bnb]) | prodigy (prodigyopt, extra [prodigy]) |
    # adafactor (torch.optim.Adafactor); adam_* and weight_decay apply where the optimizer has them
    optimizer: str = "adamw"
    mixed_precision: str = "no"  # no | fp16 | bf16
    gradient_checkpointing: bool = False
    trainable: str = "all"  # all | mhla (only the MHLA parameters: mixing, CPE, gate) | lora (see below)
    # trainable=lora: a peft LoRA adapter on every attention's to_q/to_k/to_v/to_out.0 plus the MHLA
    # parameters are trained, the rest is frozen; final/ holds adapter + MHLA for SANA / Wan
    # (mhla_gen.integration.lora), the adapter merged into the weights for DiT (DiTPipeline has no LoRA
    # loader)
    lora_rank: int = 16
    lora_alpha: float = 16.0  # the update is scaled by lora_alpha / lora_rank
    # module names (suffixes, peft's rule) that get an adapter; each must name a module of the model
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES))
    lora_dropout: float = 0.0  # peft's dropout on the adapter's input (training only)
    ema_decay: float = 0.9999  # 0 = no EMA
    checkpoint_every: int = 5_000
    checkpoints_total_limit: int = 2
    num_workers: int = -1  # DataLoader workers; -1 = min(4, CPUs available to the process)
    allow_tf32: bool = True
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self):
        if str(self.mixed_precision) in ("False", "false"):  # YAML 1.1 reads a bare `no` as a boolean
            self.mixed_precision = "no"
        if self.mixed_precision not in ("no", "fp16", "bf16"):
            raise ValueError(f"train.mixed_precision must be no, fp16 or bf16, got {self.mixed_precision!r}")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"train.lr_scheduler must be one of {list(LR_SCHEDULERS)} (diffusers' "
                             f"get_scheduler names), got {self.lr_scheduler!r}")
        if self.lr_num_cycles < 1 or self.lr_power <= 0:
            raise ValueError(f"train.lr_num_cycles must be >= 1 and train.lr_power > 0, got "
                             f"{self.lr_num_cycles} and {self.lr_power}")
        if self.trainable not in ("all", "mhla", "lora"):
            raise ValueError(f"train.trainable must be all, mhla or lora, got {self.trainable!r}")
        check_lora_settings(self.lora_rank, self.lora_alpha, "train.lora_rank", "train.lora_alpha")
        targets = self.lora_target_modules
        if not targets or not all(isinstance(m, str) and m for m in targets):
            raise ValueError(f"train.lora_target_modules must list module names (e.g. to_q, to_k, to_v, "
                             f"to_out.0), got {self.lora_target_modules!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"train.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got "
                             f"{self.optimizer!r}")
        if self.max_grad_norm is None:
            self.max_grad_norm = 0.0  # null and 0 both mean: no clipping
        for name in (
            "max_steps",
            "global_batch_size",
            "gradient_accumulation_steps",
            "checkpoint_every",
            "checkpoints_total_limit",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"train.ema_decay must be in [0, 1), got {self.ema_decay}")
        if not 0 < self.learning_rate < math.inf:  # also refuses nan
            raise ValueError(f"train.learning_rate must be a finite number > 0, got {self.learning_rate}")
        for name in ("lr_warmup_steps", "max_grad_norm", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_workers < -1:
            raise ValueError(f"train.num_workers must be >= 0 (or -1 = automatic), got {self.num_workers}")


@dataclass
class LogConfig:
    """Logging and periodic samples."""

    every: int = 100  # optimizer steps between metrics.jsonl / tracker records
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])  # Accelerate's: tensorboard, wandb
    sample_every: int = 0  # steps between sample grids (0 = only after the last step)
    num_samples: int = 8
    sample_steps: int = 50  # denoising steps of the sampling pipeline
    guidance_scale: float = 4.0

    def __post_init__(self):
        for name, low in (("every", 1), ("sample_every", 0), ("num_samples", 1), ("sample_steps", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"log.{name} must be >= {low}, got {getattr(self, name)}")
        if self.guidance_scale < 0:
            raise ValueError(f"log.guidance_scale must be >= 0, got {self.guidance_scale}")
        unknown = [name for name in self.trackers if name not in TRACKERS]
        if unknown:
            raise ValueError(f"log.trackers: unknown {unknown}; Accelerate's trackers are {list(TRACKERS)}")


@dataclass
class ShareConfig:
    """What a run's ``final/`` says about itself where it is shared (its README.md model card, a LoRA
    folder's ``mhla_lora.json``) and where it goes; local paths never leave the machine
    (mhla_gen.integration.cards)."""

    base_model: str | None = None  # hub id of the model the run starts from, named instead of a local folder
    license: str | None = None  # the card's license; default: the one a local copy of the base declares
    push_to_hub: str | None = None  # hub repo id: final/ is uploaded there at the end (huggingface_hub)

    def __post_init__(self):
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        for name in ("base_model", "push_to_hub"):
            value = getattr(self, name)
            try:
                if value is not None:
                    validate_repo_id(value)
            except HFValidationError as err:
                raise ValueError(f"share.{name}={value!r} is not a Hub repo id (owner/name): {err}") from None


@dataclass
class RunConfig:
    """Keys every training script has."""

    output_dir: str = "runs/run"
    seed: int = 0
    resume: str = "latest"  # latest | none | PATH to a checkpoint folder
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    mhla: MHLAConfig = field(default_factory=MHLAConfig)
    share: ShareConfig = field(default_factory=ShareConfig)

    def __post_init__(self):
        if not 0 <= self.seed < 2**32:  # numpy's seed range (accelerate's set_seed seeds numpy too)
            raise ValueError(f"seed must be in 0..2**32-1, got {self.seed}")
        if not self.output_dir:
            raise ValueError("output_dir must be a folder path, got ''")
        source, accepted = getattr(getattr(self, "data", None), "source", None), data_sources(type(self))
        if source is not None and accepted and source not in accepted:
            raise ValueError(f"data.source must be one of {', '.join(accepted)}, got {source!r}")


def data_sources(schema: type) -> tuple[str, ...]:
    """The ``data.source`` values of the base records that train with ``schema`` (their run config, or a
    stage-1 schema built on it): each record's ``data_sources``, in record order; each value is a class
    with its own checks (``train/dit_sources.py``, ``train/caption_sources.py``). Matched by the records'
    ``module:attribute`` references, so no task or pipeline module is imported to answer."""
    lineage = {f"{cls.__module__}:{cls.__qualname__}" for cls in schema.__mro__}
    found: dict[str, None] = {}
    for base in BASES.values():
        if base.trains and base.run_config.path in lineage:
            found.update(dict.fromkeys(base.data_sources))
    return tuple(found)


# --------------------------------------------------------------------------------------------- DiT
@dataclass
class DiTModelConfig:
    """DiT architecture. ``preset`` is ``DiT-{S,B,L,XL}/{2,4,8}``; hidden_size/depth/heads/patch_size
    override it when set (the digits main job uses a narrower, shallower DiT)."""

    preset: str = "DiT-XL/2"
    attention: str = "mhla"  # softmax | linear | mhla
    hidden_size: int | None = None
    depth: int | None = None
    heads: int | None = None
    patch_size: int | None = None
    num_classes: int = 1000
    learn_sigma: bool = True
    class_dropout_prob: float = 0.1  # CFG label dropout to the null class (id 1000, as DiTPipeline wants)
    init_from: str | None = None  # a diffusers DiT folder or hub id (fast adaptation softmax -> MHLA)
    # init_from saved with MHLA (a trained MHLA DiT, a stage-1 folder of scripts/linearize.py): `saved` keeps
    # its MHLA layers and weights (they become the run's mhla.*), `fresh` installs model.attention anew
    init_attention: str = "saved"

    def __post_init__(self):
        if self.attention not in ATTENTION_TYPES:
            raise ValueError(f"model.attention must be one of {ATTENTION_TYPES}, got {self.attention!r}")
        if not 1 <= self.num_classes <= 1000:  # DiTPipeline's null class is 1000 (see train.dit)
            raise ValueError(f"model.num_classes must be in 1..1000, got {self.num_classes}")
        if not 0.0 <= self.class_dropout_prob < 1.0:
            raise ValueError(f"model.class_dropout_prob must be in [0, 1), got {self.class_dropout_prob}")
        if self.init_attention not in ("saved", "fresh"):
            raise ValueError(f"model.init_attention must be saved or fresh, got {self.init_attention!r}")
        for name in ("hidden_size", "depth", "heads", "patch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(
                    f"model.{name} must be >= 1 (or null: the preset's), got {getattr(self, name)}"
                )


@dataclass
class DiTDataConfig:
    """``source``: ``folder`` (ImageNet-style class folders), ``latents`` (a cache written by
    scripts/extract_latents.py), ``digits`` (the embedded sklearn digits, pixel space), ``shapes`` (drawn
    mirror-symmetric coloured shapes, RGB pixel space: mhla_gen.data.shapes) or ``teacher``
    (``teacher_samples`` samples of ``teacher_labels`` drawn from ``teacher`` through DiTPipeline with
    ``log.sample_steps`` / ``log.guidance_scale`` into ``path``, then read like a latent cache)."""

    source: str = "folder"
    path: str | None = None
    resolution: int = 256
    vae: str | None = "stabilityai/sd-vae-ft-ema"  # local folder or hub id; None = pixel space
    vae_subfolder: str | None = None
    hflip: bool = True
    teacher: str | None = None  # data.source=teacher: the DiT to sample (default: what init_from converts)
    teacher_samples: int = 0
    teacher_labels: list[int] | None = None  # default: every class, in turn
    # data.source=hf: a datasets dataset (save_to_disk folder, load_dataset folder or hub name) with an image
    # and an integer class column (mhla_gen.data.hf_datasets)
    split: str = "train"
    image_column: str = "image"
    label_column: str = "label"

    def __post_init__(self):
        if self.resolution < 1:
            raise ValueError(f"data.resolution must be a positive number of pixels, got {self.resolution}")
        if self.source == "teacher" and self.teacher_samples < 1:
            raise ValueError(
                f"data.source=teacher needs data.teacher_samples >= 1 (how many to draw), got "
                f"{self.teacher_samples}"
            )
        if self.teacher_labels is not None and not self.teacher_labels:
            raise ValueError("data.teacher_labels is empty: list the classes to sample (or null for all)")


@dataclass
class DiffusionConfig:
    """DDPM training schedule (DiT: linear betas, 1000 steps) and the sampler used for sample grids."""

    num_train_timesteps: int = 1000
    beta_schedule: str = "linear"
    beta_start: float = 0.0001
    beta_end: float = 0.02
    sampler: str = "ddim"  # ddim | dpm | ddpm
    snr_gamma: float | None = None  # Min-SNR-γ loss weighting of the ε term (Hang et al. 2023); None: off

    def __post_init__(self):
        if self.snr_gamma is not None and not self.snr_gamma > 0:
            raise ValueError(f"diffusion.snr_gamma must be > 0 or null (off), got {self.snr_gamma}")
        if self.sampler not in ("ddim", "dpm", "ddpm"):
            raise ValueError(f"diffusion.sampler must be ddim, dpm or ddpm, got {self.sampler!r}")
        if self.num_train_timesteps < 2:
            raise ValueError(f"diffusion.num_train_timesteps must be >= 2, got {self.num_train_timesteps}")


@dataclass
class EvalConfig:
    """End-of-run FID for the digits main job (features from mhla_gen.metrics' digits extractor)."""

    fid_num_samples: int = 0  # 0 = no FID
    fid_batch_size: int = 250

    def __post_init__(self):
        if self.fid_num_samples < 0 or self.fid_num_samples == 1:
            raise ValueError(f"eval.fid_num_samples must be 0 (off) or >= 2, got {self.fid_num_samples}")
        if self.fid_batch_size < 1:
            raise ValueError(f"eval.fid_batch_size must be >= 1, got {self.fid_batch_size}")


@dataclass
class DiTRunConfig(RunConfig):
    output_dir: str = "runs/dit"
    model: DiTModelConfig = field(default_factory=DiTModelConfig)
    data: DiTDataConfig = field(default_factory=DiTDataConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# ------------------------------------------------------------------------------------ SANA and Wan
@dataclass
class FinetuneModelConfig:
    """A pretrained diffusers checkpoint (folder or hub id) and the attention to fine-tune it into."""

    pretrained: str = ""
    attention: str = "mhla"
    revision: str | None = None
    dtype: str = "float32"  # weights of the frozen parts (text encoder, VAE): float32 | bfloat16 | float16
    # a saved transformer folder to start from instead of the checkpoint's own (e.g. the stage-1 folder of
    # scripts/linearize.py): the same key as DiT's; init_attention as in DiT's model section
    init_from: str | None = None
    init_attention: str = "saved"
    # which of the pipeline's transformers this run trains: Wan2.2 A14B has two experts, ``transformer``
    # (high noise, σ >= the pipeline's boundary_ratio) and ``transformer_2`` (low noise, σ below it)
    expert: str = "transformer"
    transformer: str | None = None  # deprecated name of init_from (moved there, with a warning)
    # CFG caption dropout: this share of the training items sees the empty prompt's embedding (what the
    # pipelines' unconditional branch encodes), drawn per item and step; DiT's is model.class_dropout_prob
    caption_dropout_prob: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.caption_dropout_prob < 1.0:
            raise ValueError(f"model.caption_dropout_prob must be in [0, 1), got {self.caption_dropout_prob}")
        if self.expert not in ("transformer", "transformer_2"):
            raise ValueError(f"model.expert must be transformer or transformer_2, got {self.expert!r}")
        if self.transformer is not None:
            if self.init_from not in (None, self.transformer):
                raise ValueError(
                    f"model.transformer={self.transformer!r} (the old name of model.init_from) and "
                    f"model.init_from={self.init_from!r} disagree; set model.init_from only"
                )
            warnings.warn("model.transformer is now model.init_from (the same key for every base); "
                          "using it as model.init_from", FutureWarning, stacklevel=2)
            self.init_from, self.transformer = self.transformer, None
        if self.attention not in ATTENTION_TYPES:
            raise ValueError(f"model.attention must be one of {ATTENTION_TYPES}, got {self.attention!r}")
        if self.init_attention not in ("saved", "fresh"):
            raise ValueError(f"model.init_attention must be saved or fresh, got {self.init_attention!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass
class FlowMatchingConfig:
    """SD3/SANA-style rectified flow: x_t = (1 - σ) x_0 + σ ε, target ε - x_0, σ from ``weighting``."""

    weighting: str = "logit_normal"  # logit_normal | mode | uniform (diffusers.training_utils names)
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float | None = None  # None = the checkpoint scheduler's shift
    # the loss's weight per σ (diffusers.training_utils.compute_loss_weighting_for_sd3): none | sigma_sqrt
    # (σ⁻²) | cosmap (2 / (π (1 - 2σ + 2σ²))); diffusers' --weighting_scheme=cosmap is weighting=uniform
    # with loss_weighting=cosmap
    loss_weighting: str = "none"
    # diffusion forcing (block-causal video models, mhla.chunk_frames): every chunk of the latent video
    # draws its own σ (weighting, shift and loss weight per chunk), the transformer a per-token timestep
    per_chunk_noise: bool = False

    def __post_init__(self):
        if self.weighting not in ("logit_normal", "mode", "uniform"):
            raise ValueError(f"flow.weighting must be logit_normal, mode or uniform, got {self.weighting!r}")
        if self.loss_weighting not in FLOW_LOSS_WEIGHTINGS:
            raise ValueError(f"flow.loss_weighting must be one of {', '.join(FLOW_LOSS_WEIGHTINGS)}, got "
                             f"{self.loss_weighting!r}")
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"flow.shift must be > 0 (or null for the checkpoint's), got {self.shift}")


@dataclass
class CaptionDataConfig:
    """A folder of images or videos with captions (metadata.jsonl or a .txt file per item). ``source``:
    ``folder`` (``path`` holds the data) or ``teacher`` (``teacher_samples`` images / videos of the
    prompts in ``prompts_file``, in turn, sampled from ``model.pretrained`` through its stock pipeline
    into ``path`` with ``log.sample_steps`` / ``log.guidance_scale``, then read as a folder)."""

    path: str = ""
    cache_dir: str | None = None  # latents + text embeddings cache; None = output_dir/cache
    height: int = 512
    width: int = 512
    num_frames: int = 81  # video only: 4k + 1
    max_sequence_length: int = 300
    sample_prompts: list[str] = field(default_factory=lambda: ["a photo of a cat"])
    source: str = "folder"
    prompts_file: str | None = None  # data.source=teacher: one prompt per line
    teacher_samples: int = 0
    # data.source=hf: a datasets dataset (mhla_gen.data.hf_datasets); data.source=shards: webdataset-style tar
    # shards, key.jpg/png/mp4 + key.txt (mhla_gen.data.shards); data.path names either
    split: str = "train"
    image_column: str = "image"  # SANA
    video_column: str = "video"  # Wan
    caption_column: str = "text"
    hflip: bool = False  # random horizontal flips (the cache then holds each item's latents flipped too)
    # aspect-ratio buckets: null (every item cropped to height x width), `auto` (sizes of about
    # height x width pixels, aspect ratios up to 2:1 either way, multiples of what the VAE / patch /
    # pipeline tile) or a list of [height, width]; each item goes to the bucket nearest its aspect ratio and
    # every batch holds one bucket (mhla_gen.data.buckets)
    buckets: Any = None
    # video: which num_frames frames of each clip: first (from frame 0), uniform (spread over the clip),
    # random (a start drawn once per item from the run's seed); frame_stride: every n-th frame (first, random)
    frame_sampling: str = "first"
    frame_stride: int = 1
    clips: int = 1000  # data.source=moving_shapes (video models): clips drawn in code (data/moving_shapes.py)

    def __post_init__(self):
        for name in ("height", "width", "num_frames", "max_sequence_length", "frame_stride", "clips"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.frame_sampling not in FRAME_SAMPLINGS:
            raise ValueError(f"data.frame_sampling must be one of {', '.join(FRAME_SAMPLINGS)}, got "
                             f"{self.frame_sampling!r}")
        if self.frame_sampling == "uniform" and self.frame_stride != 1:
            raise ValueError(f"data.frame_stride={self.frame_stride} does not apply to data.frame_sampling="
                             f"uniform (its frames are spread over the whole clip); leave it at 1")
        self.buckets = check_buckets(self.buckets)
        if not self.sample_prompts:
            raise ValueError("data.sample_prompts must hold at least one prompt (for the sample grids)")
        if self.source == "teacher" and (self.teacher_samples < 1 or not self.prompts_file):
            raise ValueError(
                "data.source=teacher needs data.prompts_file (one prompt per line) and data.teacher_samples "
                f">= 1 (how many to draw), got {self.prompts_file!r} and {self.teacher_samples}"
            )


@dataclass
class SanaRunConfig(RunConfig):
    output_dir: str = "runs/sana"
    model: FinetuneModelConfig = field(default_factory=FinetuneModelConfig)
    data: CaptionDataConfig = field(default_factory=CaptionDataConfig)
    flow: FlowMatchingConfig = field(default_factory=FlowMatchingConfig)


@dataclass
class WanRunConfig(RunConfig):
    output_dir: str = "runs/wan"
    model: FinetuneModelConfig = field(default_factory=FinetuneModelConfig)
    data: CaptionDataConfig = field(
        default_factory=lambda: CaptionDataConfig(height=480, width=832, max_sequence_length=512)
    )
    flow: FlowMatchingConfig = field(default_factory=FlowMatchingConfig)

    def __post_init__(self):
        super().__post_init__()
        if (self.data.num_frames - 1) % 4:
            raise ValueError(f"data.num_frames must be 4k + 1 (1, 5, 9, ..., 81), got {self.data.num_frames}")


# ------------------------------------------------------------------------------------------ loading
def load_config(
    schema: type[T], config_file: str | Path | None = None, overrides: list[str] | None = None
) -> T:
    """``schema`` defaults, then ``config_file`` (YAML), then ``overrides`` (``key=value`` dotlist).

    Raises:
        FileNotFoundError: ``config_file`` does not exist.
        ConfigError: an unknown key, a wrong type or an invalid value; the message names it and where it
            came from (the file or the command line).
    """
    merged, given = OmegaConf.structured(schema), set()

    def loaded(conf):
        given.update(_leaf_keys(conf))
        return conf

    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist")
        merged = _merge(merged, lambda: loaded(_without_retired(OmegaConf.load(path), schema)), f"in {path}")
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"command-line overrides must look like key=value, got {bad}")
        command_line = lambda: loaded(OmegaConf.from_dotlist(list(overrides)))
        merged = _merge(merged, command_line, "on the command line")
    try:
        cfg = _expand_home(OmegaConf.to_object(merged))  # runs every __post_init__ check
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid config: {_short(err)}") from None
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_finite(cfg)
    object.__setattr__(cfg, _GIVEN, frozenset(given))
    return cfg


_GIVEN = "_given_settings"  # the attribute load_config leaves on the config it returns


def given_settings(cfg) -> frozenset[str] | None:
    """The dotted settings (``train.max_grad_norm``) that the config file or the command line gave, of a
    config made by :func:`load_config`; None for a config built in code (everything in it is as meant)."""
    return getattr(cfg, _GIVEN, None)


def _leaf_keys(conf, prefix: str = "") -> set[str]:
    """Dotted keys of every leaf (value or list) of an OmegaConf tree."""
    keys = set()
    for key, value in conf.items_ex(resolve=False):
        if OmegaConf.is_dict(value):
            keys |= _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def _check_finite(value, key: str = "") -> None:
    """``ConfigError`` naming the key of the first inf / nan number anywhere in a loaded config: no setting
    means anything with them (a learning rate of inf trains to all-NaN weights; nan passes every ``<``
    check)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} must be a finite number")
    if dataclasses.is_dataclass(value):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return
    for name, item in items:
        _check_finite(item, f"{key}{name}" if str(name).startswith("[") or not key else f"{key}.{name}")


def _without_retired(conf, schema: type):
    """The ``config.yaml`` of a run from an earlier version still loads: its ``debug`` section (test-only
    fault injection, now ``tests/fault_injection.py``) is dropped. On the command line it is unknown."""
    if isinstance(schema, type) and issubclass(schema, RunConfig) and "debug" in conf:
        conf.pop("debug")
    return conf


def _expand_home(cfg: T) -> T:
    """``~`` expanded in every string setting that starts with it (paths: ``output_dir=~/runs/x``, a
    quoted ``data.path=~/imnet``), as the shell would have done for an unquoted path."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            _expand_home(value)
        elif isinstance(value, str) and value.startswith("~"):
            setattr(cfg, f.name, os.path.expanduser(value))
    return cfg


def _merge(base, load, where: str):
    """``OmegaConf.merge(base, load())``; errors become a ConfigError saying ``where`` they came from."""
    import yaml

    try:
        return OmegaConf.merge(base, load())
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(f"invalid config {where}: {_short(err)}") from None


def _short(err: Exception) -> str:
    """OmegaConf's message without its ``reference_type`` / ``object_type`` lines."""
    lines = str(err).splitlines()
    return "\n".join(ln for ln in lines if not ln.strip().startswith(("reference_type", "object_type")))


def config_to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_to_dict(cfg: Any) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))
