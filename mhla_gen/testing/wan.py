"""Tiny Wan models and a tiny ``WanPipeline``, built in-process from config dicts (no hub, no downloads).

For tests and smoke runs only: random weights, so generated videos are noise. The transformer keeps
Wan's real structure (3D patch embedding, 3D RoPE, RMSNorm across heads, cross-attention on UMT5
features); only the widths and depths are tiny.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from ..integration.install import install_mhla, mhla_processors
from ..processors.config import MHLAConfig
from .tiny import TinyBase, caption_forward_kwargs, on_model

TEXT_DIM = 32

TINY_WAN_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,  # Wan's RoPE splits the head dim into t / h / w parts: 4 / 4 / 4 here
    in_channels=16,
    out_channels=16,
    text_dim=TEXT_DIM,
    freq_dim=32,
    ffn_dim=32,
    num_layers=3,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=32,
)

TINY_UMT5_CONFIG = dict(
    vocab_size=64,
    d_model=TEXT_DIM,
    d_kv=8,
    d_ff=64,
    num_layers=1,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)

TINY_VAE_CONFIG = dict(
    base_dim=3,
    z_dim=16,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
)

_WORDS = (
    "a an the cat dog bird fish horse car tree river sky sea moon sun red blue green white black small big "
    "runs flies swims walks jumps on in over under at night day video of with and"
).split()


def tiny_wan_transformer(seed: int = 0, **overrides) -> WanTransformer3DModel:
    """A 3-layer Wan transformer (2 heads of dim 12) with random weights."""
    torch.manual_seed(seed)
    return WanTransformer3DModel(**{**TINY_WAN_CONFIG, **overrides}).eval()


def tiny_wan_mhla(cfg: MHLAConfig, dtype: torch.dtype = torch.float64, seed: int = 1,
                  **overrides) -> WanTransformer3DModel:
    """:func:`tiny_wan_transformer` (``overrides``) in ``dtype`` with ``cfg`` installed (block-causal with
    ``cfg.chunk_frames``), each MHLA layer's mixing moved away from its init by a generator seeded ``seed``:
    weights uniform in [0.1, 0.6), its other parameters (a stream's decays) standard normal, so that every
    block pair and every head's decay shows in a comparison."""
    model = install_mhla(tiny_wan_transformer(**overrides).to(dtype), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for proc in mhla_processors(model).values():
            for name, p in proc.mixing.named_parameters():
                p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.1 if name == "weight"
                        else torch.randn(p.shape, generator=g))
    return model


def tiny_wan_inputs(latent_shape: tuple[int, ...], dtype: torch.dtype = torch.float64, seed: int = 0,
                    text_tokens: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random latents ``latent_shape`` ``(B, C, F, H, W)`` and caption embeddings ``(B, text_tokens,
    TEXT_DIM)`` for the tiny Wan, in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(latent_shape, generator=g).to(dtype)
    return latent, torch.randn(latent_shape[0], text_tokens, TEXT_DIM, generator=g).to(dtype)


def tiny_tokenizer(max_length: int = 16) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a few dozen words; ``</s>`` is appended as T5 does."""
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(_WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_length,
    )


def tiny_text_encoder(seed: int = 0) -> UMT5EncoderModel:
    torch.manual_seed(seed)
    return UMT5EncoderModel(UMT5Config(**TINY_UMT5_CONFIG)).eval()


def tiny_vae(seed: int = 0) -> AutoencoderKLWan:
    """Wan's causal 3D VAE, tiny: 8x spatial and 4x temporal compression, 16 latent channels."""
    torch.manual_seed(seed)
    return AutoencoderKLWan(**TINY_VAE_CONFIG).eval()


def tiny_wan_pipeline(transformer: WanTransformer3DModel | None = None, seed: int = 0) -> WanPipeline:
    """A stock ``WanPipeline`` of tiny components (UniPC flow-matching scheduler, as Wan2.1 ships)."""
    return WanPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed),
        transformer=transformer if transformer is not None else tiny_wan_transformer(seed),
        vae=tiny_vae(seed),
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
    )


I2V_TEXT_TOKENS = 512  # diffusers' Wan I2V cross-attention splits the image tokens off after exactly 512


def wan_forward_kwargs(model, latents, timestep, generator, labels=None) -> dict:
    """Wan T2V: caption embeddings of width ``text_dim``. Wan2.1 I2V (``image_dim`` set): 512 text tokens and
    5 CLIP image tokens (``encoder_hidden_states_image``); Wan2.2 I2V (36 channels, no CLIP): text only."""
    image_dim = model.config.get("image_dim")
    kwargs = caption_forward_kwargs(model, latents, timestep, generator, width="text_dim",
                                    text_tokens=I2V_TEXT_TOKENS if image_dim else 5)
    if image_dim:
        image = torch.randn(len(latents), 5, image_dim, generator=generator)
        kwargs["encoder_hidden_states_image"] = on_model(model, image)
    return kwargs


def sample_wan(pipe, generator) -> torch.Tensor:
    """Two steps of a tiny ``WanPipeline``, 5 frames at 48 x 64 px: latents ``(1, 16, 2, 6, 8)``."""
    return pipe("a red car", height=48, width=64, num_frames=5, num_inference_steps=2, guidance_scale=2.0,
                max_sequence_length=16, output_type="latent", generator=generator).frames


TINY_WAN = TinyBase(  # the record's test reference (Base.tiny)
    model=tiny_wan_transformer,
    pipeline=tiny_wan_pipeline,
    forward_kwargs=wan_forward_kwargs,
    latent=(3, 6, 10),  # patch (1, 2, 2): token grid (3, 3, 5), blocks (2, 2, 3): uneven on every axis
    sizes=((3, 6, 10), (4, 8, 12), (5, 6, 14)),
    mhla=MHLAConfig(blocks=(2, 2, 3), layers=[1, 2], cpe_kernel=3, gate=True, wan_head_norm=True),
    sample=sample_wan,
    tiny_config="tiny/wan",
    pixels=(5, 48, 64),
)
