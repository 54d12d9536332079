"""Tiny SANA-Video and Wan2.2 models and pipelines built in-process, plus the published full-size configs.

For tests and smoke runs only: random weights, so generated videos are noise. The tiny models keep the
real structure (3D patch embedding, 3D RoPE, q/k RMSNorm across heads, cross-attention on text features);
only widths and depths are tiny. Wan2.2 variants:

* A14B (T2V / I2V): two experts, ``transformer`` for high noise (``t >= boundary_ratio * 1000``) and
  ``transformer_2`` for low noise, same architecture;
* TI2V-5B: one transformer on a 48-channel latent (its VAE compresses 16x spatially: 4x4 patchify
  inside, then 4x downsampling) and ``expand_timesteps`` (one timestep per token; the first latent
  frame is kept clean when conditioning on an image);
* Wan2.1 I2V-14B: a CLIP image encoder whose features enter the cross-attention next to the text
  (``image_dim``, ``added_kv_proj_dim``), and 36 input channels (16 noise + 16 image latents + 4 mask).
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKLWan,
    DPMSolverMultistepScheduler,
    SanaVideoPipeline,
    SanaVideoTransformer3DModel,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)

from ..processors.config import MHLAConfig
from .tiny import TinyBase, caption_forward_kwargs, tiny_gemma2
from .tiny import tiny_tokenizer as tiny_gemma_tokenizer
from .wan import (
    TINY_WAN,
    TINY_WAN_CONFIG,
    tiny_text_encoder,
    tiny_tokenizer,
    tiny_vae,
    wan_forward_kwargs,
)

TINY_SANA_VIDEO_CONFIG = dict(
    in_channels=16,
    out_channels=16,
    num_attention_heads=2,
    attention_head_dim=12,  # RoPE splits the head dim into t / h / w parts: 4 / 4 / 4 here
    num_layers=2,
    num_cross_attention_heads=2,
    cross_attention_head_dim=12,
    cross_attention_dim=24,
    caption_channels=16,
    mlp_ratio=2.5,
    sample_size=30,  # SanaVideoPipeline's resolution binning reads it (30: the 480p bins)
    patch_size=(1, 2, 2),
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)

TINY_TI2V_VAE_CONFIG = dict(
    base_dim=8,
    z_dim=48,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    latents_mean=[0.0] * 48,
    latents_std=[1.0] * 48,
    is_residual=True,
    in_channels=12,  # RGB after the 2x2 patchify
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
)

WAN22_T2V_BOUNDARY = 0.875  # Wan2.2-T2V-A14B's boundary_ratio (model_index.json)
WAN22_I2V_BOUNDARY = 0.9  # Wan2.2-I2V-A14B's

# ---- the published full-size transformer configs (diffusers' scripts/convert_*; hub config.json) -------
# Wan2.1-T2V-1.3B: get_transformer_config("Wan-T2V-1.3B") of diffusers' scripts/convert_wan_to_diffusers.py,
# plus diffusers' default rope_max_seq_len (image_dim / added_kv_proj_dim None: text-to-video)
_WAN_1_3B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
_WAN_14B = {**_WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
REAL_CONFIGS: dict[str, tuple[type, dict]] = {
    "Wan2.1-T2V-1.3B": (WanTransformer3DModel, _WAN_1_3B),
    # each of the two experts (transformer, transformer_2) of Wan2.2-T2V-A14B
    "Wan2.2-T2V-A14B": (WanTransformer3DModel, _WAN_14B),
    "Wan2.2-TI2V-5B": (
        WanTransformer3DModel,
        {
            **_WAN_14B,
            "num_attention_heads": 24,
            "in_channels": 48,
            "out_channels": 48,
            "ffn_dim": 14336,
            "num_layers": 30,
        },
    ),
    # each of the two experts of Wan2.2-I2V-A14B: 36 channels in (noise, image latents, mask), no CLIP
    "Wan2.2-I2V-A14B": (WanTransformer3DModel, {**_WAN_14B, "in_channels": 36}),
    "Wan2.1-I2V-14B-480P": (
        WanTransformer3DModel,
        {
            **_WAN_14B,
            "in_channels": 36,
            "image_dim": 1280,
            "added_kv_proj_dim": 5120,
        },
    ),
    "SANA-Video-2B-480p": (
        SanaVideoTransformer3DModel,
        dict(
            in_channels=16,
            out_channels=16,
            num_attention_heads=20,
            attention_head_dim=112,
            num_layers=20,
            num_cross_attention_heads=20,
            cross_attention_head_dim=112,
            cross_attention_dim=2240,
            caption_channels=2304,
            mlp_ratio=3.0,
            attention_bias=False,
            sample_size=30,
            patch_size=(1, 2, 2),
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=1024,
        ),
    ),
}
"""name -> (transformer class, config) of the full-size models, for meta-device tests."""


def tiny_sana_video(seed: int = 0, **overrides) -> SanaVideoTransformer3DModel:
    """A 2-layer SANA-Video transformer (2 heads of dim 12) with random weights."""
    torch.manual_seed(seed)
    return SanaVideoTransformer3DModel(**{**TINY_SANA_VIDEO_CONFIG, **overrides}).eval()


def tiny_sana_video_pipeline(transformer: SanaVideoTransformer3DModel | None = None, seed: int = 0):
    """A stock ``SanaVideoPipeline``: tiny SANA-Video, one-layer Gemma2 + word tokenizer, tiny Wan VAE
    (8x spatial, 4x temporal), flow DPM-Solver as SANA-Video ships. Call it with
    ``use_resolution_binning=False``, ``complex_human_instruction=None`` and a small
    ``max_sequence_length``."""
    transformer = transformer if transformer is not None else tiny_sana_video(seed)
    return SanaVideoPipeline(
        tokenizer=tiny_gemma_tokenizer(),
        text_encoder=tiny_gemma2(transformer.config.caption_channels, seed),
        vae=tiny_vae(seed),
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(
            flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction"
        ),
    )


def tiny_wan_expert(seed: int = 0, **overrides) -> WanTransformer3DModel:
    """One tiny Wan transformer (a Wan2.2 expert, or the TI2V / I2V transformer with ``overrides``)."""
    torch.manual_seed(seed)
    return WanTransformer3DModel(**{**TINY_WAN_CONFIG, **overrides}).eval()


def _flow_unipc() -> UniPCMultistepScheduler:
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def tiny_wan22_pipeline(transformer=None, transformer_2=None, boundary_ratio=WAN22_T2V_BOUNDARY, seed=0):
    """A stock Wan2.2 A14B-layout ``WanPipeline``: two tiny experts (different seeds) split at
    ``boundary_ratio``."""
    return WanPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed),
        transformer=transformer if transformer is not None else tiny_wan_expert(seed),
        transformer_2=transformer_2 if transformer_2 is not None else tiny_wan_expert(seed + 1),
        vae=tiny_vae(seed),
        scheduler=_flow_unipc(),
        boundary_ratio=boundary_ratio,
    )


def tiny_ti2v_vae(seed: int = 0) -> AutoencoderKLWan:
    """Wan2.2's 48-channel residual VAE, tiny: 16x spatial (2x2 patchify, 3 downsamplings), 4x temporal."""
    torch.manual_seed(seed)
    return AutoencoderKLWan(**TINY_TI2V_VAE_CONFIG).eval()


def tiny_ti2v_pipeline(transformer=None, seed: int = 0, image_to_video: bool = False):
    """A stock TI2V-5B-layout pipeline: one transformer on 48 latent channels, ``expand_timesteps``.
    ``image_to_video``: ``WanImageToVideoPipeline`` (first frame from an image), else ``WanPipeline``."""
    transformer = (
        transformer if transformer is not None else tiny_wan_expert(seed, in_channels=48, out_channels=48)
    )
    cls = WanImageToVideoPipeline if image_to_video else WanPipeline
    return cls(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed),
        transformer=transformer,
        vae=tiny_ti2v_vae(seed),
        scheduler=_flow_unipc(),
        expand_timesteps=True,
    )


def tiny_clip_vision(seed: int = 0, hidden_size: int = 8):
    """A one-layer CLIP vision tower and its image processor (32 px input, 8 px patches)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    config = CLIPVisionConfig(
        hidden_size=hidden_size,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=hidden_size,
    )
    processor = CLIPImageProcessor(crop_size=32, size={"shortest_edge": 32})
    return CLIPVisionModel(config).eval(), processor


TINY_CLIP_WIDTH = 8  # tiny_clip_vision's hidden size: the image_dim of the tiny Wan2.1 I2V transformer


def tiny_wan_i2v(seed: int = 0, **overrides) -> WanTransformer3DModel:
    """The tiny Wan2.1 I2V transformer (what :func:`tiny_wan_i2v_pipeline` builds): 36 input channels, CLIP
    image features of :func:`tiny_clip_vision`'s width in the cross-attention."""
    inner = TINY_WAN_CONFIG["num_attention_heads"] * TINY_WAN_CONFIG["attention_head_dim"]
    i2v = {"in_channels": 36, "image_dim": TINY_CLIP_WIDTH, "added_kv_proj_dim": inner}
    return tiny_wan_expert(seed, **{**i2v, **overrides})


def tiny_wan_i2v_pipeline(transformer=None, seed: int = 0) -> WanImageToVideoPipeline:
    """A stock Wan2.1-I2V-layout ``WanImageToVideoPipeline``: CLIP image features in the cross-attention
    (``image_dim``, ``added_kv_proj_dim``), 36 input channels. Call it with ``max_sequence_length=512``
    (diffusers' I2V cross-attention splits image from text tokens by assuming 512 text tokens)."""
    image_encoder, image_processor = tiny_clip_vision(seed, TINY_CLIP_WIDTH)
    transformer = transformer if transformer is not None else tiny_wan_i2v(seed)
    return WanImageToVideoPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed),
        vae=tiny_vae(seed),
        scheduler=_flow_unipc(),
        image_processor=image_processor,
        image_encoder=image_encoder,
        transformer=transformer,
    )


def tiny_wan22_i2v_pipeline(transformer=None, transformer_2=None, seed: int = 0) -> WanImageToVideoPipeline:
    """A stock Wan2.2 I2V-A14B-layout ``WanImageToVideoPipeline``: two tiny experts on 36 input channels
    (16 noise + 16 image latents + 4 mask), no CLIP image encoder (``image_dim`` None), split at
    ``boundary_ratio`` 0.9."""
    transformer, transformer_2 = (
        given if given is not None else tiny_wan_expert(seed + i, in_channels=36)
        for i, given in enumerate((transformer, transformer_2))
    )
    return WanImageToVideoPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed),
        vae=tiny_vae(seed),
        scheduler=_flow_unipc(),
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=WAN22_I2V_BOUNDARY,
    )


def sample_sana_video(pipe, generator) -> torch.Tensor:
    """Two steps of a tiny ``SanaVideoPipeline``, 5 frames at 32 x 64 px: latents ``(1, 16, 2, 4, 8)``."""
    return pipe("a red cat", height=32, width=64, frames=5, num_inference_steps=2, guidance_scale=2.0,
                max_sequence_length=8, output_type="latent", use_resolution_binning=False,
                complex_human_instruction=None, generator=generator).frames


def sample_wan_i2v(pipe, generator) -> torch.Tensor:
    """Two steps of a tiny ``WanImageToVideoPipeline`` from a red 64 x 48 image, 5 frames: latents
    ``(1, 16, 2, 6, 8)``."""
    from PIL import Image

    image = Image.new("RGB", (64, 48), (200, 30, 30))
    return pipe(image=image, prompt="a red car", height=48, width=64, num_frames=5, num_inference_steps=2,
                guidance_scale=2.0, max_sequence_length=512, output_type="latent", generator=generator).frames


# the records' test references (Base.tiny)
TINY_SANA_VIDEO = TinyBase(
    model=tiny_sana_video,
    pipeline=tiny_sana_video_pipeline,
    forward_kwargs=caption_forward_kwargs,
    latent=TINY_WAN.latent,  # patch (1, 2, 2) as Wan: token grid (3, 3, 5)
    sizes=TINY_WAN.sizes,
    mhla=MHLAConfig(blocks=(2, 2, 3), cpe_kernel=3, gate=True),
    sample=sample_sana_video,
    tiny_config="tiny/sana-video",
    pixels=(5, 32, 64),
)
TINY_WAN_I2V = TinyBase(
    model=tiny_wan_i2v,
    pipeline=tiny_wan_i2v_pipeline,
    forward_kwargs=wan_forward_kwargs,
    latent=TINY_WAN.latent,
    sizes=TINY_WAN.sizes,
    mhla=MHLAConfig(blocks=(2, 2, 3), layers=[0, 2], cpe_kernel=3, gate=True),
    sample=sample_wan_i2v,
    tiny_config="tiny/wan-i2v",  # tiny/wan with the 512 text tokens of Wan2.1 I2V
    pixels=TINY_WAN.pixels,
)
