"""DiT's model pieces for :mod:`mhla_gen.train.dit`: the paper's sizes and init, the label table that
``DiTPipeline`` needs, a pixel-space stand-in VAE and the sampling schedulers."""

from __future__ import annotations

import re

import torch
from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import DecoderOutput
from diffusers.models.embeddings import LabelEmbedding
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ..errors import ConfigError

# DiT paper, Table 1: hidden size, depth, heads
DIT_SIZES = {"S": (384, 12, 6), "B": (768, 12, 12), "L": (1024, 24, 16), "XL": (1152, 28, 16)}
_PRESET = re.compile(r"^DiT-(S|B|L|XL)/(2|4|8)$")
PIPELINE_NULL_CLASS = 1000  # DiTPipeline.__call__ hard-codes this id for the unconditional branch


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
def dit_init_config(model_cfg, in_channels: int, sample_size: int) -> dict:
    """``DiTTransformer2DModel`` arguments of a new model: ``model.*``'s size, the data's input."""
    arch = dit_architecture(model_cfg)
    return dict(
        num_attention_heads=arch["heads"],
        attention_head_dim=arch["hidden_size"] // arch["heads"],
        in_channels=in_channels,
        out_channels=2 * in_channels if model_cfg.learn_sigma else in_channels,
        num_layers=arch["depth"],
        sample_size=sample_size,
        patch_size=arch["patch_size"],
        num_embeds_ada_norm=label_table_size(model_cfg.num_classes),
    )


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


def check_blocks_fit(mhla, grid: int, resolution: int, patch: int) -> None:
    """The MHLA blocks (None: softmax) fit DiT's ``grid x grid`` token grid (``data.resolution`` pixels,
    patch size ``patch``); ConfigError naming them otherwise."""
    if mhla is not None and (len(mhla.blocks) != 2 or any(b > grid for b in mhla.blocks)):
        raise ConfigError(
            f"mhla.blocks={list(mhla.blocks)} does not fit DiT's {grid}x{grid} token grid "
            f"(data.resolution={resolution}, patch size {patch})"
        )


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
