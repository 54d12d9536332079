"""Tiny DiT / SANA models and pipelines built from config dicts, for tests and smoke runs (seconds on CPU).

No model hub: the SANA text encoder is a one-layer ``Gemma2Model`` and its tokenizer a word-level
``tokenizers`` vocabulary built in-process (unknown words map to ``<unk>``). Every factory takes keyword
overrides of its config, e.g. ``tiny_dit(sample_size=10)``.
"""

from __future__ import annotations

import torch

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
