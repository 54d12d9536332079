"""Stock diffusers Wan pipelines whose transformers run MHLA self-attention: ``WanPipeline`` (Wan2.1 T2V,
Wan2.2 T2V-A14B with its two experts, Wan2.2 TI2V-5B) and ``WanImageToVideoPipeline`` (Wan2.1 I2V, Wan2.2
I2V-A14B, TI2V-5B from an image).

    pipe = load_wan_pipeline("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", transformer_path="runs/wan-mhla/final")
    frames = pipe("a cat surfing", height=480, width=832, num_frames=81).frames[0]

    # Wan2.2 A14B: transformer (high noise, t >= boundary_ratio * 1000) and transformer_2 (low noise)
    pipe = load_wan_pipeline("Wan-AI/Wan2.2-T2V-A14B-Diffusers", transformer_path="runs/high/final",
                             transformer_2_path="runs/low/final")

Three ways to get each MHLA transformer, in this order (``pipelines.load_pipeline_transformer``):

1. ``transformer_path`` / ``transformer_2_path``: a folder written by ``transformer.save_pretrained`` after
   ``install_mhla`` (fine-tuning output, or ``scripts/convert_wan_mhla.py`` for the released checkpoint);
2. ``path_or_id/transformer`` (``/transformer_2``) when that local folder was saved with MHLA;
3. otherwise the stock pretrained transformer, with ``mhla`` (``mhla_2``) installed fresh (untrained
   mixing: a starting point for fine-tuning, not a sampler that will produce good videos).

MHLA replaces the video self-attention (``attn1``) only; the cross-attention (``attn2``: text, and the
I2V models' CLIP image features) stays stock.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers import DiffusionPipeline, WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel

from mhla_gen.errors import ConfigError
from mhla_gen.processors.config import MHLAConfig

from . import PipelineSampler, SampleSettings, check_frames, load_pipeline_transformer
from .checks import video_token_grid
from .conditions import open_image

WAN_DEFAULT_SIZE = (480, 832)  # WanPipeline's default height and width

EXPERTS = ("transformer", "transformer_2")
"""The component names of Wan2.2's two experts (high noise, low noise); Wan2.1 has the first only."""


def has_component(path_or_id, name: str) -> bool:
    """Whether the pipeline's ``model_index.json`` names a (non-null) component ``name``."""
    library, _ = DiffusionPipeline.load_config(path_or_id).get(name, (None, None))
    return library is not None


def load_wan_experts(
    path_or_id, mhla=None, mhla_2=None, torch_dtype=None, transformer_path=None, transformer_2_path=None
) -> dict[str, WanTransformer3DModel]:
    """``{"transformer": ..., "transformer_2": ...}`` with MHLA in each (the second only when the pipeline
    has one, or ``transformer_2_path`` is given). ``mhla_2`` defaults to ``mhla``; pass another config to
    choose the second expert's hybrid layers (or blocks) on their own."""
    experts = {
        "transformer": load_pipeline_transformer(
            WanTransformer3DModel, path_or_id, mhla, torch_dtype, transformer_path
        )
    }
    if transformer_2_path is not None or has_component(path_or_id, "transformer_2"):
        experts["transformer_2"] = load_pipeline_transformer(
            WanTransformer3DModel,
            path_or_id,
            mhla if mhla_2 is None else mhla_2,
            torch_dtype,
            transformer_2_path,
            subfolder="transformer_2",
        )
    return experts


def _load(pipeline_cls, path_or_id, mhla, mhla_2, torch_dtype, device, paths, dtypes):
    experts = load_wan_experts(path_or_id, mhla, mhla_2, torch_dtype, *paths)
    pipe = pipeline_cls.from_pretrained(path_or_id, **experts, dtype={"default": torch_dtype, **dtypes})
    return pipe.to(device) if device is not None else pipe


def load_wan_pipeline(
    path_or_id,
    mhla: MHLAConfig | None = None,
    torch_dtype: torch.dtype = torch.bfloat16,
    device=None,
    transformer_path=None,
    vae_dtype: torch.dtype = torch.float32,
    mhla_2: MHLAConfig | None = None,
    transformer_2_path=None,
) -> WanPipeline:
    """Load a ``WanPipeline`` with MHLA transformers (both experts of a Wan2.2 A14B pipeline).

    Args:
        path_or_id: a diffusers Wan pipeline folder or hub id (text encoder, tokenizer, VAE, scheduler).
        mhla: MHLA to install on a stock transformer. Must be None (or equal) when the transformer was
            saved with MHLA: a fresh install would throw the trained MHLA weights away.
        torch_dtype: dtype of the transformers and text encoder.
        device: where to move the pipeline (None: stay on CPU).
        transformer_path: a saved MHLA transformer folder to use instead of ``path_or_id/transformer``.
        vae_dtype: the Wan VAE is usually run in float32, as the Wan examples in diffusers do.
        mhla_2, transformer_2_path: the same for Wan2.2's low-noise expert ``transformer_2``
            (``mhla_2`` None: ``mhla``).
    Returns:
        the pipeline; ``pipe.transformer.mhla_config`` (and ``pipe.transformer_2``'s) tells which MHLA it
        runs (absent: stock softmax).
    Raises:
        ValueError: ``mhla`` conflicts with the MHLA a transformer was saved with, or a saved transformer is
            not a ``WanTransformer3DModel``.
    """
    paths = (transformer_path, transformer_2_path)
    return _load(WanPipeline, path_or_id, mhla, mhla_2, torch_dtype, device, paths, {"vae": vae_dtype})


def load_wan_i2v_pipeline(
    path_or_id,
    mhla: MHLAConfig | None = None,
    torch_dtype: torch.dtype = torch.bfloat16,
    device=None,
    transformer_path=None,
    vae_dtype: torch.dtype = torch.float32,
    mhla_2: MHLAConfig | None = None,
    transformer_2_path=None,
) -> WanImageToVideoPipeline:
    """Load a ``WanImageToVideoPipeline`` with MHLA transformers; arguments as :func:`load_wan_pipeline`.
    The CLIP image encoder (Wan2.1 I2V) runs in float32, as diffusers' Wan I2V example loads it."""
    paths = (transformer_path, transformer_2_path)
    dtypes = {"vae": vae_dtype, "image_encoder": torch.float32}
    return _load(WanImageToVideoPipeline, path_or_id, mhla, mhla_2, torch_dtype, device, paths, dtypes)


def check_wan_size(transformer_config: dict, height: int, width: int, spatial: int = 8) -> None:
    """``height x width`` pixels are whole tokens for the VAE's ``spatial`` factor and the transformer's
    patch (its ``config.json`` as a dict), within its rotary table (``rope_max_seq_len``); ConfigError
    naming the setting otherwise."""
    _, ph, pw = transformer_config["patch_size"]
    rope_max = transformer_config.get("rope_max_seq_len", 1024)
    for name, value, patch in (("height", height, ph), ("width", width, pw)):
        if value % (spatial * patch):
            raise ConfigError(f"--{name} {value} is not a multiple of {spatial * patch} "
                              f"(VAE {spatial}x, patch {patch})")
        if value // (spatial * patch) > rope_max:
            raise ConfigError(
                f"--height/--width {height}x{width} gives a token grid of {height // (spatial * ph)}x"
                f"{width // (spatial * pw)}, beyond this model's rope_max_seq_len={rope_max}; pass a "
                f"smaller --height/--width"
            )


class WanSampler(PipelineSampler):
    """``WanPipeline``: prompts, videos of ``frames`` frames (4k + 1)."""

    @classmethod
    def load(cls, path_or_id, mhla, torch_dtype, device, transformer_path):
        return load_wan_pipeline(path_or_id, mhla, torch_dtype, device, transformer_path=transformer_path)

    @classmethod
    def token_grid(cls, configs: dict, settings: SampleSettings) -> tuple[int, int, int] | None:
        """The token grid of ``settings``, after :func:`check_wan_size` and the ``4k + 1`` frames are checked
        from the configs (so a size the model cannot take is refused before ``--out`` is claimed)."""
        height, width = settings.height or WAN_DEFAULT_SIZE[0], settings.width or WAN_DEFAULT_SIZE[1]
        vae = configs.get("vae")
        if vae is not None:
            temporal = vae.get("scale_factor_temporal", 4)
            check_wan_size(configs["transformer"], height, width, vae.get("scale_factor_spatial", 8))
            if settings.frames is not None and (settings.frames - 1) % temporal:
                raise ConfigError(f"--frames {settings.frames} must be {temporal}k + 1")
        return video_token_grid(configs, height, width, settings.frames)

    @classmethod
    def fit_size(cls, pipe, settings: SampleSettings) -> SampleSettings:
        """``(height, width)`` (default 480 x 832), refused when the VAE and patch cannot tile it or its token
        grid exceeds the model's rotary table (``rope_max_seq_len``); frames must be 4k + 1."""
        height, width = settings.height or WAN_DEFAULT_SIZE[0], settings.width or WAN_DEFAULT_SIZE[1]
        check_wan_size(dict(pipe.transformer.config), height, width, pipe.vae_scale_factor_spatial)
        check_frames(settings, pipe)
        return dataclasses.replace(settings, height=height, width=width)

    @classmethod
    def sample(cls, pipe, conditions, generator, settings: SampleSettings):
        optional = settings.optional(num_frames="frames", max_sequence_length="max_sequence_length",
                                     output_type="output_type")
        return pipe(prompt=list(conditions), negative_prompt=settings.negative_prompt,
                    height=settings.height, width=settings.width, num_inference_steps=settings.steps,
                    guidance_scale=settings.guidance, generator=generator, **optional,
                    **settings.extra).frames


I2V_TEXT_TOKENS = 512  # diffusers' Wan I2V cross-attention splits image from text tokens at 512 text tokens


class WanI2VSampler(WanSampler):
    """``WanImageToVideoPipeline``: ``(prompt, image)`` pairs (an image path or a PIL image), one video each,
    whose first frame is the image; sizes and frames as :class:`WanSampler`."""

    @classmethod
    def load(cls, path_or_id, mhla, torch_dtype, device, transformer_path):
        return load_wan_i2v_pipeline(path_or_id, mhla, torch_dtype, device, transformer_path=transformer_path)

    @classmethod
    def fit_size(cls, pipe, settings: SampleSettings) -> SampleSettings:
        """As :meth:`WanSampler.fit_size`, and :meth:`check_settings`."""
        cls.check_settings(dict(pipe.transformer.config), settings)
        return super().fit_size(pipe, settings)

    @classmethod
    def check_settings(cls, transformer_config: dict, settings: SampleSettings) -> None:
        """A model with CLIP image features (Wan2.1 I2V) takes exactly 512 text tokens
        (``max_sequence_length`` None: the pipeline's 512)."""
        image_dim, length = transformer_config.get("image_dim"), settings.max_sequence_length
        if image_dim is not None and length not in (None, I2V_TEXT_TOKENS):
            raise ConfigError(f"max_sequence_length={length}: this Wan I2V model (CLIP image features, "
                              f"image_dim={image_dim}) takes exactly {I2V_TEXT_TOKENS} text tokens; set it "
                              f"to {I2V_TEXT_TOKENS}")

    @classmethod
    def sample(cls, pipe, conditions, generator, settings: SampleSettings):
        """One pipeline call per ``(prompt, image)`` pair (diffusers' I2V pipeline repeats one image's
        features over a batch); ``generator``: one for all, or one per pair. Returns the videos."""
        cls.check_settings(dict(pipe.transformer.config), settings)
        generators = generator if isinstance(generator, list) else [generator] * len(conditions)
        optional = settings.optional(num_frames="frames", max_sequence_length="max_sequence_length",
                                     output_type="output_type")
        videos = []
        for (prompt, image), gen in zip(conditions, generators, strict=True):
            videos += list(pipe(image=open_image(image), prompt=[prompt],
                                negative_prompt=settings.negative_prompt, height=settings.height,
                                width=settings.width, num_inference_steps=settings.steps,
                                guidance_scale=settings.guidance, generator=gen, **optional,
                                **settings.extra).frames)
        return videos
