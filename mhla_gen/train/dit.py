"""DiT from scratch (or adapted from a pretrained softmax DiT): the task of scripts/train_dit.py.

Model: diffusers ``DiTTransformer2DModel`` with the DiT paper's sizes and adaLN-Zero init; attention is
softmax, global linear (MHLA with one block) or MHLA. Objective: DDPM with learned sigma
(:class:`DDPMLoss`), CFG label dropout (done once per sample here; see :func:`disable_block_label_dropout`),
horizontal flips. Data: class folders (VAE on the fly), a latent cache, or the embedded digits in pixel
space. Samples come out of diffusers' ``DiTPipeline``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DDPMScheduler,
    DiTPipeline,
    DiTTransformer2DModel,
    DPMSolverMultistepScheduler,
)
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import DecoderOutput
from diffusers.models.embeddings import LabelEmbedding
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from torch.utils.data import Dataset

from ..config import MHLAConfig
from ..data import ClassFolderDataset, LatentCacheDataset, digits_tensors, shapes
from ..data.images import class_folders, require_dir
from ..data.teacher import TEACHER_DATA, write_teacher_samples
from ..folders import check_apart, owned, read_marker
from ..metrics.extractors import digits_extractor, extract_features
from ..metrics.fid import fid_from_features
from .attention import (
    attention_mhla_config,
    check_mhla_layers,
    install_attention,
    load_start_transformer,
    load_teacher,
    saved_mhla,
    start_attention,
)
from .config import ConfigError, DiTRunConfig
from .loop import TrainTask
from .objectives import DDPMLoss

logger = logging.getLogger(__name__)

# DiT paper, Table 1: hidden size, depth, heads
DIT_SIZES = {"S": (384, 12, 6), "B": (768, 12, 12), "L": (1024, 24, 16), "XL": (1152, 28, 16)}
_PRESET = re.compile(r"^DiT-(S|B|L|XL)/(2|4|8)$")
PIPELINE_NULL_CLASS = 1000  # DiTPipeline.__call__ hard-codes this id for the unconditional branch
DIGITS_CLASSES, DIGITS_ITEMS = 10, 1797  # scikit-learn's load_digits
EMBEDDED = ("digits", "shapes")  # pixel-space data drawn in code (no data.path, no VAE)


def _same_model(a: str, b: str) -> bool:
    """Two model references name the same thing: equal hub ids, or local paths to the same folder."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def dit_architecture(model_cfg) -> dict:
    """``{hidden_size, depth, heads, patch_size}`` from the preset plus explicit overrides."""
    match = _PRESET.match(model_cfg.preset)
    if match is None:
        raise ValueError(
            f"model.preset must look like DiT-S/2, DiT-B/4, DiT-L/8 or DiT-XL/2, got {model_cfg.preset!r}"
        )
    hidden, depth, heads = DIT_SIZES[match.group(1)]
    arch = {
        "hidden_size": model_cfg.hidden_size or hidden,
        "depth": model_cfg.depth or depth,
        "heads": model_cfg.heads or heads,
        "patch_size": model_cfg.patch_size or int(match.group(2)),
    }
    if arch["hidden_size"] % arch["heads"]:
        raise ValueError(
            f"model.hidden_size={arch['hidden_size']} is not divisible by model.heads={arch['heads']}"
        )
    return arch


@torch.no_grad()
def dit_initialize_(transformer: nn.Module) -> None:
    """DiT's init (``models.py: initialize_weights``): xavier linears, N(0, 0.02) embeddings, and the
    adaLN-Zero part: every block's modulation and the output layers start at zero."""
    for m in transformer.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    conv = transformer.pos_embed.proj
    nn.init.xavier_uniform_(conv.weight.view(conv.weight.shape[0], -1))
    nn.init.zeros_(conv.bias)
    for block in transformer.transformer_blocks:
        emb = block.norm1.emb
        nn.init.normal_(emb.class_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(emb.timestep_embedder.linear_1.weight, std=0.02)
        nn.init.normal_(emb.timestep_embedder.linear_2.weight, std=0.02)
        nn.init.zeros_(block.norm1.linear.weight)
        nn.init.zeros_(block.norm1.linear.bias)
    for layer in (transformer.proj_out_1, transformer.proj_out_2):
        nn.init.zeros_(layer.weight)
        nn.init.zeros_(layer.bias)


def disable_block_label_dropout(transformer: nn.Module) -> None:
    """diffusers' DiT has one label embedder per block, each dropping labels independently with the
    global RNG while training; DiT drops a sample's label once. The task drops labels itself (seeded,
    once per sample), so the embedders' own dropout is switched off (the null row stays)."""
    for m in transformer.modules():
        if isinstance(m, LabelEmbedding):
            m.dropout_prob = 0.0


def label_table_size(num_classes: int) -> int:
    """``num_embeds_ada_norm`` for a ``num_classes`` DiT: always 1000 (null row at index 1000).

    ``DiTPipeline.__call__`` hard-codes class 1000 for the unconditional branch, so smaller datasets keep
    the 1000-entry label table (rows ``num_classes..999`` are never used) and the model samples with the
    stock pipeline, ``mhla_gen.pipelines.dit`` and ``eval/`` unchanged. The null id used for label dropout is
    this value too.
    """
    if num_classes > PIPELINE_NULL_CLASS:
        raise ValueError(
            f"model.num_classes={num_classes}: DiTPipeline uses class {PIPELINE_NULL_CLASS} as the "
            f"null label, so at most {PIPELINE_NULL_CLASS} classes are supported"
        )
    return PIPELINE_NULL_CLASS


class IdentityVAE(ModelMixin, ConfigMixin):
    """A pixel-space stand-in for ``AutoencoderKL`` in ``DiTPipeline``: ``decode(z).sample = z``, scale 1."""

    @register_to_config
    def __init__(self, scaling_factor: float = 1.0):
        super().__init__()
        self.register_buffer("anchor", torch.zeros(()), persistent=False)  # gives the module a device

    def decode(self, z, return_dict: bool = True):
        return DecoderOutput(sample=z) if return_dict else (z,)


def identity_vae() -> IdentityVAE:
    return IdentityVAE()


def make_sampler(name: str, train_scheduler):
    """The sampling scheduler ``diffusion.sampler`` (ddim | dpm | ddpm) on the training schedule."""
    classes = {"ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler, "ddpm": DDPMScheduler}
    if name not in classes:
        raise ValueError(f"diffusion.sampler must be one of {sorted(classes)}, got {name!r}")
    config = {k: v for k, v in train_scheduler.config.items() if k != "variance_type"}
    return classes[name].from_config(config)


class _DigitsDataset(Dataset):
    def __init__(self, resolution: int):
        images, self.labels = digits_tensors(resolution)
        self.pixels = images * 2.0 - 1.0  # [-1, 1] as DiTPipeline's output mapping expects

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"pixels": self.pixels[i], "class_labels": self.labels[i]}


class DiTTask(TrainTask):
    name = "dit"

    def __init__(self, cfg: DiTRunConfig):
        super().__init__(cfg)
        d = cfg.diffusion
        self.scheduler = DDPMScheduler(
            num_train_timesteps=d.num_train_timesteps,
            beta_schedule=d.beta_schedule,
            beta_start=d.beta_start,
            beta_end=d.beta_end,
            clip_sample=False,
            variance_type="learned_range" if cfg.model.learn_sigma else "fixed_small",
        )
        self.objective = DDPMLoss(self.scheduler, cfg.model.learn_sigma)
        self.vae = None  # the data's AutoencoderKL, frozen (setup); None in pixel space
        self.latent_scale = 1.0
        self._dataset = None

    # ---------------------------------------------------------------------------------- model
    def _vae_config(self) -> dict | None:
        """The data VAE's ``config.json`` (no weights loaded), or None in pixel space."""
        data = self.cfg.data
        if data.vae is None or data.source in EMBEDDED:
            return None
        try:
            return dict(AutoencoderKL.load_config(data.vae, subfolder=data.vae_subfolder))
        except OSError as err:
            raise ConfigError(f"data.vae={data.vae!r} cannot be loaded: {err}") from None

    def _channels_and_size(self) -> tuple[int, int]:
        """``(in_channels, sample_size)`` of the transformer input."""
        data = self.cfg.data
        if data.source in EMBEDDED:
            return (1 if data.source == "digits" else 3), data.resolution
        if data.source == "latents":
            shape = LatentCacheDataset(data.path).latents.shape  # (N, 2, C, h, w)
            return shape[2], shape[3]
        if data.source == "teacher":  # samples of the teacher's own input size
            config = self._teacher_config()
            return config["in_channels"], config["sample_size"]
        vae = self._vae_config()
        if vae is None:
            return 3, data.resolution
        factor = 2 ** (len(vae["block_out_channels"]) - 1)
        if data.resolution % factor:
            raise ConfigError(
                f"data.resolution={data.resolution} is not a multiple of the VAE's downsampling {factor}"
            )
        return vae["latent_channels"], data.resolution // factor

    # ------------------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Data folder, class count, the latent cache's VAE, resolution vs VAE and patch, MHLA blocks and
        layers vs the model, init_from."""
        m, data = self.cfg.model, self.cfg.data
        arch = dit_architecture(m)
        m.attention, self.cfg.mhla = self.attention()  # config.yaml records what the run trains
        if data.source == "digits" and m.num_classes != DIGITS_CLASSES:
            raise ConfigError(
                f"model.num_classes={m.num_classes} but data.source=digits has {DIGITS_CLASSES} classes"
            )
        if data.source == "shapes":
            shapes.check_shapes_data(data.resolution, m.num_classes)
        if data.source not in EMBEDDED:
            if data.path is None:
                raise ConfigError(f"data.path is required for data.source={data.source}")
            if data.source == "teacher":
                self._check_teacher_data()
            else:
                self._check_classes()
        if data.source == "latents":
            self._check_cache_vae()
        channels, size = self._channels_and_size()
        if size % arch["patch_size"]:
            raise ConfigError(
                f"data.resolution={data.resolution} gives a {size}x{size} model input, which patch size "
                f"{arch['patch_size']} does not tile (model.patch_size / model.preset)"
            )
        grid = size // arch["patch_size"]
        mhla = attention_mhla_config(m.attention, self.cfg.mhla)
        if mhla is not None and (len(mhla.blocks) != 2 or any(b > grid for b in mhla.blocks)):
            raise ConfigError(
                f"mhla.blocks={list(mhla.blocks)} does not fit DiT's {grid}x{grid} token grid "
                f"(data.resolution={data.resolution}, patch size {arch['patch_size']})"
            )
        check_mhla_layers(mhla, self.depth())
        if m.init_from:
            self._check_init_from(channels, size)
        if self.cfg.train.distill.enabled and not Path(self.distill_source()).exists():
            self._check_teacher_id(self.distill_source())
        if self.cfg.eval.fid_num_samples and data.source != "digits":
            raise ConfigError(
                f"eval.fid_num_samples={self.cfg.eval.fid_num_samples} is for data.source=digits only "
                f"(score other data with eval/generate.py + eval/fid.py); set it to 0"
            )

    def _check_classes(self) -> None:
        """``model.num_classes`` must equal the data's class count (folders, or the latent cache's labels)."""
        data, want = self.cfg.data, self.cfg.model.num_classes
        root = require_dir(data.path, "data.path")
        if data.source == "folder":
            found = len(class_folders(root, "data.path"))
            what = f"{found} class folders with images"
        else:
            cache = LatentCacheDataset(root)
            found = int(cache.meta.get("num_classes", int(cache.labels.max()) + 1))
            if len(cache.labels) and int(cache.labels.max()) >= want:
                raise ConfigError(
                    f"model.num_classes={want} but the latent cache data.path={data.path!r} holds label "
                    f"{int(cache.labels.max())}"
                )
            what = f"{found} classes (its meta.json)"
        if found != want:
            raise ConfigError(f"model.num_classes={want} but data.path={data.path!r} has {what}")

    def _check_cache_vae(self) -> None:
        """A latent cache records the VAE and scaling factor it was encoded with; ``data.vae`` (which
        decodes the samples) must be that VAE, with that scaling factor."""
        data = self.cfg.data
        meta = LatentCacheDataset(data.path).meta
        if data.vae is None:
            return  # no decoder: sample grids are skipped (logged)
        scale = self._vae_config().get("scaling_factor")  # the VAE must load, before any work
        recorded, subfolder = meta.get("vae"), meta.get("vae_subfolder", data.vae_subfolder)
        if recorded is None or (_same_model(data.vae, recorded) and data.vae_subfolder == subfolder):
            if meta.get("scaling_factor") in (None, scale):
                return
            raise ConfigError(
                f"the latent cache data.path={data.path!r} was scaled by {meta['scaling_factor']}, but "
                f"data.vae={data.vae!r} has scaling_factor {scale}"
            )
        raise ConfigError(
            f"the latent cache data.path={data.path!r} was encoded with vae={recorded!r}"
            + (f" (subfolder {meta['vae_subfolder']!r})" if meta.get("vae_subfolder") else "")
            + f", but data.vae={data.vae!r}: set data.vae={recorded!r} (samples are decoded with data.vae)"
        )

    # ----------------------------------------------------------------------------- teacher data
    def teacher_source(self) -> str:
        """``data.teacher``, else :meth:`pretrained_teacher` (a stage-1 folder's teacher, not the folder)."""
        source = self.cfg.data.teacher or self.pretrained_teacher()
        if source is None:
            raise ConfigError(
                "data.source=teacher needs data.teacher (or model.init_from): the DiT to sample"
            )
        return source

    def _teacher_config(self) -> dict:
        source = self.teacher_source()
        path = Path(source)
        sub = "transformer" if (path / "transformer").is_dir() or not path.exists() else None
        try:
            config = DiTTransformer2DModel.load_config(source, subfolder=sub)
        except OSError as err:
            raise ConfigError(f"data.teacher={source!r} cannot be loaded: {err}") from None
        if config.get("_class_name") != "DiTTransformer2DModel":
            raise ConfigError(f"data.teacher={source!r} is a {config.get('_class_name')}, not a DiT")
        return config

    def teacher_labels(self) -> list[int]:
        data, classes = self.cfg.data, self.cfg.model.num_classes
        chosen = data.teacher_labels or list(range(classes))
        return [chosen[i % len(chosen)] for i in range(data.teacher_samples)]

    def _check_teacher_data(self) -> None:
        """The teacher loads, its labels are the model's classes, and data.path may be written."""
        self._teacher_config()
        bad = sorted({c for c in self.teacher_labels() if not 0 <= c < self.cfg.model.num_classes})
        if bad:
            raise ConfigError(
                f"data.teacher_labels {bad} are outside model.num_classes={self.cfg.model.num_classes}"
            )
        owned(self.cfg.data.path, TEACHER_DATA, "data.path")
        check_apart(self.cfg.data.path, "data.path", {"data.teacher": self.teacher_source()})

    @torch.no_grad()
    def _sample_teacher(self, device) -> None:
        """``data.teacher_samples`` samples of the teacher into ``data.path`` (resumable), in the space the
        model trains in: pixels in [-1, 1], or VAE latents (encoded as extract_latents.py does)."""
        data, teacher = self.cfg.data, load_teacher(DiTTransformer2DModel, self.teacher_source()).to(device)
        pipe = DiTPipeline(transformer=teacher, vae=self.vae if self.vae is not None else identity_vae(),
                           scheduler=make_sampler(self.cfg.diffusion.sampler, self.scheduler)).to(device)
        pipe.set_progress_bar_config(disable=True)

        def generate(labels: list[int], chunk: int) -> torch.Tensor:
            g = torch.Generator(device).manual_seed(self.cfg.seed * 100_003 + chunk)
            images = pipe(class_labels=labels, guidance_scale=self.cfg.log.guidance_scale, generator=g,
                          num_inference_steps=self.cfg.log.sample_steps, output_type="pt").images
            x = images.to(device) * 2 - 1  # (B, C, H, W) in [-1, 1]
            if self.vae is None:
                return x
            return self.vae.encode(x.to(self.vae.dtype)).latent_dist.sample(g) * self.latent_scale

        fingerprint = {
            "teacher": self.teacher_source(), "labels": self.teacher_labels(), "seed": self.cfg.seed,
            "steps": self.cfg.log.sample_steps, "guidance": self.cfg.log.guidance_scale,
            "sampler": self.cfg.diffusion.sampler, "vae": data.vae,
        }
        meta = {"vae": data.vae, "vae_subfolder": data.vae_subfolder, "scaling_factor": self.latent_scale,
                "teacher": self.teacher_source()}
        write_teacher_samples(generate, data.path, self.teacher_labels(), fingerprint, meta)

    def count_items(self) -> int:
        data = self.cfg.data
        if data.source == "digits":
            return DIGITS_ITEMS
        if data.source == "shapes":
            return shapes.TRAIN_ITEMS
        if data.source == "teacher":
            return data.teacher_samples
        if data.source == "latents":
            return len(LatentCacheDataset(data.path))
        return len(self._folder_dataset())

    def _folder_dataset(self):
        """The class-folder dataset (listed once: validation counts it, training reads it)."""
        if self._dataset is None:
            self._dataset = ClassFolderDataset(self.cfg.data.path, self.cfg.data.resolution, "data.path")
        return self._dataset

    def depth(self) -> int:
        """Transformer blocks of the model trained: ``model.init_from``'s, else the configured size's."""
        m = self.cfg.model
        if m.init_from:
            path = Path(m.init_from)
            sub = "transformer" if (path / "transformer").is_dir() or not path.exists() else None
            try:
                return DiTTransformer2DModel.load_config(m.init_from, subfolder=sub)["num_layers"]
            except OSError as err:
                raise ConfigError(f"model.init_from={m.init_from!r} cannot be loaded: {err}") from None
        return dit_architecture(m)["depth"]

    def init_folder(self) -> Path | None:
        """The local folder holding ``model.init_from``'s transformer (its ``transformer/`` in a pipeline
        folder), or None (no init_from, or a hub id)."""
        path = Path(self.cfg.model.init_from or "")
        if not self.cfg.model.init_from or not path.is_dir():
            return None
        return path / "transformer" if (path / "transformer").is_dir() else path

    def attention(self) -> tuple[str, MHLAConfig]:
        """``(model.attention, mhla)`` this run trains: as configured, or the MHLA that ``model.init_from``
        was saved with (``model.init_attention=saved``, see :func:`start_attention`)."""
        m = self.cfg.model
        folder = self.init_folder()
        return start_attention(m.attention, self.cfg.mhla, folder, m.init_attention, "model.init_from")

    def pretrained_teacher(self) -> str | None:
        """The model this run converts: the teacher a stage-1 ``model.init_from`` records, or
        ``model.init_from`` itself when it is a stock (softmax) DiT; None without one."""
        folder = self.init_folder()
        recorded = (read_marker(folder) or {}).get("teacher") if folder is not None else None
        return recorded or (self.cfg.model.init_from if saved_mhla(folder) is None else None)

    def distill_source(self) -> str:
        """``train.distill.teacher``, else :meth:`pretrained_teacher`."""
        source = self.cfg.train.distill.teacher or self.pretrained_teacher()
        if source is None:
            raise ConfigError(
                "train.distill needs a teacher: set train.distill.teacher=PATH (or start from a stock model "
                "or a stage-1 folder with model.init_from)"
            )
        return source

    @staticmethod
    def _check_teacher_id(source: str) -> None:
        try:
            DiTTransformer2DModel.load_config(source, subfolder="transformer")
        except OSError as err:
            raise ConfigError(f"train.distill teacher {source!r} cannot be loaded: {err}") from None

    def distill_teacher(self) -> nn.Module:
        return load_teacher(DiTTransformer2DModel, self.distill_source())

    def _check_init_from(self, channels: int, size: int) -> None:
        """``model.init_from`` must be a DiT whose input and label table fit the data."""
        m = self.cfg.model
        path = Path(m.init_from)
        sub = "transformer" if (path / "transformer").is_dir() or not path.exists() else None
        try:
            config = DiTTransformer2DModel.load_config(m.init_from, subfolder=sub)
        except OSError as err:
            raise ConfigError(f"model.init_from={m.init_from!r} cannot be loaded: {err}") from None
        if config.get("_class_name") != "DiTTransformer2DModel":
            raise ConfigError(
                f"model.init_from={m.init_from!r} is a {config.get('_class_name')}, not a DiT transformer"
            )
        got = (config.get("in_channels"), config.get("sample_size"), config.get("num_embeds_ada_norm"))
        need = (channels, size, label_table_size(m.num_classes))
        if got != need:
            raise ConfigError(
                f"model.init_from={m.init_from!r} has (in_channels, sample_size, num_classes) = {got}, "
                f"the data/config need {need}"
            )

    def signature(self) -> dict:
        channels, size = self._channels_and_size()
        attention, mhla = self.attention()
        return {
            "architecture": dit_architecture(self.cfg.model),
            "in_channels": channels,
            "sample_size": size,
            "num_classes": self.cfg.model.num_classes,
            "learn_sigma": self.cfg.model.learn_sigma,
            "attention": attention,
            "mhla": attention_mhla_config(attention, mhla).to_dict() if attention != "softmax" else None,
        }

    def model_record(self) -> dict:
        """``num_classes``: the labels this model was trained on (sample.py and generate.py check them)."""
        return {"num_classes": self.cfg.model.num_classes}

    def build_transformer(self) -> nn.Module:
        m = self.cfg.model
        arch = dit_architecture(m)
        channels, size = self._channels_and_size()
        if m.init_from:
            self._check_init_from(channels, size)
            attention, mhla = self.attention()
            if self.init_folder() is not None:
                transformer = load_start_transformer(
                    DiTTransformer2DModel, self.init_folder(), attention, mhla, m.init_attention
                )
                disable_block_label_dropout(transformer)
                return transformer
            transformer = DiTTransformer2DModel.from_pretrained(m.init_from, subfolder="transformer")
        else:
            transformer = DiTTransformer2DModel(
                num_attention_heads=arch["heads"],
                attention_head_dim=arch["hidden_size"] // arch["heads"],
                in_channels=channels,
                out_channels=2 * channels if m.learn_sigma else channels,
                num_layers=arch["depth"],
                sample_size=size,
                patch_size=arch["patch_size"],
                num_embeds_ada_norm=label_table_size(m.num_classes),
            )
            dit_initialize_(transformer)
        disable_block_label_dropout(transformer)
        return install_attention(transformer, m.attention, self.cfg.mhla)

    # ----------------------------------------------------------------------------------- data
    def setup(self, accelerator) -> None:
        """In latent space (``data.vae`` set, not digits): the data's ``AutoencoderKL``, frozen, on the
        device. It encodes class-folder images on the fly and decodes the sample grids."""
        self.load_vae(accelerator.device)
        if self.cfg.data.source == "teacher":
            self._sample_teacher(accelerator.device)

    def load_vae(self, device) -> None:
        """The data's ``AutoencoderKL`` (``data.vae``), frozen, on ``device``; nothing in pixel space."""
        data = self.cfg.data
        if data.vae is not None and data.source not in EMBEDDED:
            self.vae = AutoencoderKL.from_pretrained(data.vae, subfolder=data.vae_subfolder)
            self.vae.requires_grad_(False).eval().to(device)
            self.latent_scale = self.vae.config.scaling_factor

    def build_dataset(self, accelerator) -> Dataset:
        data = self.cfg.data
        if data.source == "digits":
            return _DigitsDataset(data.resolution)
        if data.source == "shapes":
            return shapes.ShapesDataset(data.resolution)
        if data.path is None:
            raise ValueError(f"data.path is required for data.source={data.source}")
        if data.source in ("latents", "teacher"):
            return LatentCacheDataset(data.path)
        return self._folder_dataset()

    def held_out_dataset(self) -> Dataset | None:
        """Images training never sees (stage 1's measurements): the shapes have a held-out draw."""
        if self.cfg.data.source == "shapes":
            return shapes.ShapesDataset(self.cfg.data.resolution, 256, seed=shapes.HELD_OUT_SEED)
        return None

    def _clean_input(self, batch: dict, rnd) -> torch.Tensor:
        """x0 ``(B, C, h, w)``: flipped per sample (seeded), VAE-encoded when training in latent space."""
        flip = (rnd.rand() < 0.5) & self.cfg.data.hflip  # (B,) bool, drawn even when flips are off
        if "latents" in batch:  # cache holds [image, flipped image]
            pair = batch["latents"]
            return torch.where(flip.view(-1, 1, 1, 1), pair[:, 1], pair[:, 0])
        x = batch["pixels"]
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
        if self.cfg.data.source in EMBEDDED or self.vae is None:
            return x
        with torch.no_grad():
            dist = self.vae.encode(x.to(self.vae.dtype)).latent_dist
            z = dist.mean + dist.std * rnd.randn(*dist.mean.shape[1:]).to(dist.mean.dtype)
        return z.float() * self.latent_scale

    def model_inputs(self, batch: dict, rnd) -> tuple[dict, tuple]:
        """The transformer's keyword inputs for one micro-batch (noised at sampled timesteps, labels dropped
        for CFG) and what the objective compares its output with: ``(x0, xt, noise, t)``."""
        x0 = self._clean_input(batch, rnd)
        drop = rnd.rand() < self.cfg.model.class_dropout_prob
        labels = torch.where(drop, label_table_size(self.cfg.model.num_classes), batch["class_labels"])
        t = rnd.randint(self.objective.num_timesteps)
        noise = rnd.randn(*x0.shape[1:])
        xt = self.scheduler.add_noise(x0, noise, t)
        return {"hidden_states": xt, "timestep": t, "class_labels": labels}, (x0, xt, noise, t)

    def loss(self, model, batch: dict, rnd) -> torch.Tensor:
        inputs, target = self.model_inputs(batch, rnd)
        out = model(**inputs, return_dict=False)[0]
        return self.objective(out, *target) + self.distillation(out, inputs)

    # -------------------------------------------------------------------------------- samples
    def pipeline(self, transformer):
        """``DiTPipeline`` around ``transformer``: the data's VAE (after :meth:`setup`; identity in pixel
        space) and the ``diffusion.sampler`` scheduler."""
        vae = self.vae if self.vae is not None else identity_vae()
        return DiTPipeline(
            transformer=transformer,
            vae=vae,
            scheduler=make_sampler(self.cfg.diffusion.sampler, self.scheduler),
        )

    @torch.no_grad()
    def generate(self, transformer, labels: list[int], seed: int, output_type: str = "pil"):
        pipe = self.pipeline(transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe(
            class_labels=labels,
            guidance_scale=self.cfg.log.guidance_scale,
            num_inference_steps=self.cfg.log.sample_steps,
            output_type=output_type,
            generator=torch.Generator(transformer.device).manual_seed(seed),
        ).images

    def sample_images(self, transformer) -> tuple[list, int]:
        """``num_samples`` per class for (up to) the first 10 classes: one row per class."""
        if self.vae is None and self.cfg.data.source == "latents":  # (teacher data in pixel space decodes)
            logger.warning("no data.vae to decode latents with: sample grids skipped")
            return [], 1
        classes = min(self.cfg.model.num_classes, 10)
        per_class = max(1, self.cfg.log.num_samples)
        labels = [c for c in range(classes) for _ in range(per_class)]
        return self.generate(transformer, labels, seed=self.cfg.seed), per_class

    def finish(self, transformer, accelerator) -> dict:
        """FID (digits feature extractor) between generated and real digits, for the digits source."""
        ev = self.cfg.eval
        if ev.fid_num_samples <= 0 or self.cfg.data.source != "digits":  # validate() refused the latter
            return {}
        n_classes = self.cfg.model.num_classes
        labels = [i % n_classes for i in range(ev.fid_num_samples)]
        fake = torch.cat(
            [
                self.generate(
                    transformer,
                    labels[i : i + ev.fid_batch_size],
                    seed=self.cfg.seed + 1 + i,
                    output_type="pt",
                ).cpu()
                for i in range(0, len(labels), ev.fid_batch_size)
            ]
        )  # (N, 1, R, R) in [0, 1]
        real, _ = digits_tensors(self.cfg.data.resolution)
        extractor = digits_extractor()
        fake_f, real_f = extract_features(extractor, fake), extract_features(extractor, real)
        accuracy = (
            (torch.from_numpy(fake_f["logits"]).argmax(-1) == torch.tensor(labels)).float().mean().item()
        )
        return {
            "fid_digits": fid_from_features(real_f["pool"], fake_f["pool"]),
            "label_accuracy": accuracy,
            "fid_num_samples": ev.fid_num_samples,
        }
