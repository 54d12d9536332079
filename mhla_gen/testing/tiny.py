"""Tiny DiT / SANA models and pipelines built from config dicts, for tests and smoke runs (seconds on CPU),
and :class:`TinyBase`, the test reference every base record carries (``Base.tiny``).

No model hub: the SANA text encoder is a one-layer ``Gemma2Model`` and its tokenizer a word-level
``tokenizers`` vocabulary built in-process (unknown words map to ``<unk>``). Every factory takes keyword
overrides of its config, e.g. ``tiny_dit(sample_size=10)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..processors.config import MHLAConfig


@dataclass(frozen=True)
class TinyBase:
    """What the tests build for one base record (``Base.tiny``), declared once, as diffusers'
    ``ModelTesterMixin`` has each model declare its class and dummy inputs: the cross-cutting tests
    (diffusers' loaders, LoRA, compile, offloading, save / load, FSDP, conversion, attention statistics)
    read it for every record in ``mhla_gen.bases``.

    Attributes:
        model: ``model(seed=0, **config overrides)`` -> a tiny transformer of the record's class, random
            weights.
        pipeline: ``pipeline(transformer=None)`` -> the record's stock diffusers pipeline of tiny components
            (its own tiny transformer when none is given).
        forward_kwargs: ``forward_kwargs(model, latents, timestep, generator, labels=None)`` -> the keyword
            arguments of ``model(**kwargs)`` around ``latents (B, C, *latent)`` and ``timestep (B,)``: the
            conditioning the transformer takes (class labels, caption embeddings of its width, image
            features), on the model's device and dtype. Also what ``example_inputs`` of the attention
            statistics calls for any model of the record, tiny or not.
        latent: the spatial size of the test latents, ``(H, W)`` or ``(F, H, W)``: a token grid uneven on
            some axis for :attr:`mhla`'s blocks.
        sizes: latent sizes the shape tests run (:attr:`latent` first): token grids even and uneven for
            :attr:`mhla`'s blocks.
        mhla: the test MHLA config: CPE and gate on (their parameters must survive every path), uneven
            blocks, some layers only where the model has several.
        sample: ``sample(pipe, generator)`` -> the output of a 2-step call of :attr:`pipeline`'s pipeline
            (latents where the pipeline can return them).
        tiny_config: the shipped tiny training config of the record (``mhla_gen.configs``: ``tiny/dit``).
        pixels: the size :attr:`sample` generates, ``(height, width)`` or ``(frames, height, width)``: a size
            its pipeline takes (what the tests ask ``mhla-gen generate`` / ``sample`` for).
    """

    model: Callable[..., Any]
    pipeline: Callable[..., Any]
    forward_kwargs: Callable[..., dict]
    latent: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]
    mhla: MHLAConfig
    sample: Callable[..., Any]
    tiny_config: str
    pixels: tuple[int, ...]

    def inputs(self, model, batch: int = 2, latent: tuple[int, ...] | None = None, seed: int = 0) -> dict:
        """Forward kwargs of ``model`` on seeded random latents ``(batch, in_channels, *latent)`` (default
        :attr:`latent`) at timesteps spread over 10..700."""
        g = torch.Generator().manual_seed(seed)
        latents = torch.randn(batch, model.config.in_channels, *(latent or self.latent), generator=g)
        timestep = torch.linspace(10, 700, batch).round()
        return self.forward_kwargs(model, latents, timestep, g)

    def output(self, model, **inputs_args) -> torch.Tensor:
        """``model``'s output on :meth:`inputs` (with gradients: wrap in ``torch.no_grad()`` to compare)."""
        return model(**self.inputs(model, **inputs_args), return_dict=False)[0]


def on_model(model, tensor: torch.Tensor, dtype: bool = True) -> torch.Tensor:
    """``tensor`` on ``model``'s device (and in its dtype: diffusers' ``model.dtype``, the dtype of its
    weights outside ``_keep_in_fp32_modules``)."""
    return tensor.to(model.device, model.dtype) if dtype else tensor.to(model.device)


def caption_forward_kwargs(model, latents, timestep, generator, labels=None, width: str = "caption_channels",
                           text_tokens: int = 5) -> dict:
    """Forward kwargs of a caption-conditioned transformer: random caption embeddings ``(B, text_tokens,
    config[width])``, the timestep in the model's dtype."""
    text = torch.randn(len(latents), text_tokens, model.config[width], generator=generator)
    return {"hidden_states": on_model(model, latents), "encoder_hidden_states": on_model(model, text),
            "timestep": on_model(model, timestep)}


def dit_forward_kwargs(model, latents, timestep, generator, labels=None) -> dict:
    """DiT: integer timesteps and class labels (default ``0, 1, ...`` modulo the smaller of 10 and the
    model's classes)."""
    if labels is None:
        labels = torch.arange(len(latents)) % min(model.config.num_embeds_ada_norm, 10)
    return {"hidden_states": on_model(model, latents), "timestep": on_model(model, timestep.long(), False),
            "class_labels": on_model(model, labels, False)}

# DiTPipeline hard-codes the classifier-free-guidance null class as 1000, so tiny DiTs keep a 1000-class
# label table (1001 rows incl. the null row); train on labels 0..k-1 for a k-class dataset.
TINY_DIT_CONFIG = dict(
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=4,
    out_channels=8,  # learned sigma, as DiT-XL/2: DiTPipeline splits eps / variance
    num_layers=2,
    sample_size=8,
    patch_size=2,
    norm_num_groups=4,
    num_embeds_ada_norm=1000,
)

TINY_SANA_CONFIG = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=8,
    num_layers=2,
    num_cross_attention_heads=2,
    cross_attention_head_dim=8,
    cross_attention_dim=16,
    caption_channels=16,
    sample_size=16,  # SanaPipeline wants sizes divisible by 32: 32 px -> 16x16 latent with the tiny DC-AE
    patch_size=1,
)

TINY_VOCAB = ["<pad>", "<unk>", "<bos>", "<eos>"] + (
    "a an the of and with on in photo picture painting digit cat dog red green blue small large "
    "zero one two three four five six seven eight nine"
).split()


def tiny_dit(**overrides):
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(overrides.pop("seed", 0))
    return DiTTransformer2DModel(**{**TINY_DIT_CONFIG, **overrides})


def tiny_sana(**overrides):
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(overrides.pop("seed", 0))
    return SanaTransformer2DModel(**{**TINY_SANA_CONFIG, **overrides})


def tiny_tokenizer():
    """Word-level fast tokenizer over :data:`TINY_VOCAB` (lower-cased, whitespace/punctuation split)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TINY_VOCAB)}, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )


def tiny_gemma2(hidden_size: int = 16, seed: int = 0):
    """One-layer Gemma2 text encoder whose width is SANA's ``caption_channels``."""
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    config = Gemma2Config(
        vocab_size=len(TINY_VOCAB),
        hidden_size=hidden_size,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    config._attn_implementation = "eager"
    return Gemma2Model(config).eval()


def tiny_autoencoder_kl(latent_channels: int = 4, seed: int = 0):
    """Two-level ``AutoencoderKL``: 2x spatial compression."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
    ).eval()


def tiny_autoencoder_dc(latent_channels: int = 4, seed: int = 0):
    """Two-level ``AutoencoderDC`` (SANA's VAE): 2x spatial compression."""
    from diffusers import AutoencoderDC

    torch.manual_seed(seed)
    return AutoencoderDC(
        in_channels=3,
        latent_channels=latent_channels,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    ).eval()


def tiny_dit_pipeline(transformer=None, **transformer_overrides):
    """A stock ``DiTPipeline`` (tiny DiT, tiny VAE, DDIM) generating ``2 * sample_size`` pixel images."""
    from diffusers import DDIMScheduler, DiTPipeline

    transformer = transformer if transformer is not None else tiny_dit(**transformer_overrides)
    vae = tiny_autoencoder_kl(transformer.config.in_channels)
    id2label = {i: f"class {i}" for i in range(10)}
    return DiTPipeline(transformer=transformer, vae=vae, scheduler=DDIMScheduler(), id2label=id2label)


def tiny_sana_pipeline(transformer=None, **transformer_overrides):
    """A stock ``SanaPipeline`` (tiny SANA, tiny Gemma2 + word tokenizer, tiny DC-AE, flow-matching Euler).

    Call it with ``use_resolution_binning=False`` (sizes are tiny) and a small ``max_sequence_length``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline

    transformer = transformer if transformer is not None else tiny_sana(**transformer_overrides)
    return SanaPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_gemma2(transformer.config.caption_channels),
        vae=tiny_autoencoder_dc(transformer.config.in_channels),
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


@torch.no_grad()
def dit_forward(model, size: int = 8, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Output ``(batch, out_channels, size, size)`` of a DiT on seeded random latents (in the model's dtype),
    steps and labels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, model.config.in_channels, size, size, generator=g).to(model.dtype)
    return model(x, timestep=torch.arange(batch) * 100, class_labels=torch.arange(batch)).sample


@torch.no_grad()
def sana_forward(model, size: int = 8, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Output of a SANA transformer on seeded random latents ``(batch, C, size, size)`` and captions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, model.config.in_channels, size, size, generator=g)
    text = torch.randn(batch, 3, model.config.caption_channels, generator=g)
    x, text = x.to(model.dtype), text.to(model.dtype)
    return model(x, encoder_hidden_states=text, timestep=torch.arange(batch) * 100.0).sample


OFFLOAD_MODES = ("cpu_offload", "group_leaf_disk", "group_block_disk")


def offload(model: torch.nn.Module, mode: str, folder) -> None:
    """Offload ``model`` in place the way the offloading tests do: ``cpu_offload`` (accelerate: weights on
    the meta device between calls) or diffusers' group offloading to disk under ``folder``, leaf- or
    block-level (``group_leaf_disk`` / ``group_block_disk``: weights replaced by empty tensors between
    calls)."""
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"offload mode must be one of {OFFLOAD_MODES}, got {mode!r}")
    if mode == "cpu_offload":
        from accelerate import cpu_offload

        cpu_offload(model, execution_device=torch.device("cpu"))
        return
    from diffusers.hooks import apply_group_offloading

    apply_group_offloading(
        model,
        onload_device=torch.device("cpu"),
        offload_device=torch.device("cpu"),
        offload_type=mode.split("_")[1] + "_level",
        num_blocks_per_group=1 if "block" in mode else None,
        offload_to_disk_path=str(folder),
    )


def sample_dit(pipe, generator) -> Any:
    """Two DDIM steps of a tiny ``DiTPipeline`` for classes 1 and 2: images ``(2, 16, 16, 3)``."""
    return pipe(class_labels=[1, 2], num_inference_steps=2, generator=generator, output_type="np").images


def sample_sana(pipe, generator) -> torch.Tensor:
    """Two steps of a tiny ``SanaPipeline`` at 32 x 32 px: latents ``(1, 4, 16, 16)``."""
    return pipe("a red cat", num_inference_steps=2, height=32, width=32, generator=generator,
                output_type="latent", use_resolution_binning=False, max_sequence_length=8,
                complex_human_instruction=None).images


# the records' test references (Base.tiny): DiT's position embedding is built for sample_size 8 (token
# grid 4 x 4 with patch 2), so its latents keep that size in the fixed-shape tests
TINY_DIT = TinyBase(
    model=tiny_dit,
    pipeline=tiny_dit_pipeline,
    forward_kwargs=dit_forward_kwargs,
    latent=(8, 8),  # token grid (4, 4): 3 blocks of 2, 1, 1 rows
    sizes=((8, 8), (12, 12), (10, 10)),
    mhla=MHLAConfig(blocks=(3, 2), layers=[1], cpe_kernel=3, gate=True),
    sample=sample_dit,
    tiny_config="tiny/dit",
    pixels=(16, 16),
)
TINY_SANA = TinyBase(
    model=tiny_sana,
    pipeline=tiny_sana_pipeline,
    forward_kwargs=caption_forward_kwargs,
    latent=(6, 10),  # patch 1: token grid (6, 10), blocks (2, 3): uneven on the width
    sizes=((6, 10), (8, 12), (7, 11)),
    mhla=MHLAConfig(blocks=(2, 3), cpe_kernel=3, gate=True),
    sample=sample_sana,
    tiny_config="tiny/sana",
    pixels=(32, 32),
)
