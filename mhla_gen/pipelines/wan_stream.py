"""Streaming video from a block-causal Wan model (MHLA, softmax with a KV cache, or both): chunk by chunk,
each chunk conditioned on the clean chunks before it through the model's cache
(``mhla_gen.integration.streaming``, ``docs/streaming.md``).

    pipe = load_wan_pipeline(WAN_DIR, transformer_path="runs/wan-stream/final")     # MHLA with chunk_frames
    video = stream_video(pipe, "a cat surfing", num_frames=161, num_inference_steps=8).frames[0]

For each chunk of ``chunk_frames`` latent frames (CausVid / Self-Forcing style):

1. draw its noise and denoise it with its own ``num_inference_steps`` steps of a fresh copy of the
   pipeline's scheduler (Wan2.1 ships UniPC with flow sigmas), the transformer reading the cache of the
   chunks before it (a step leaves the cache as it is);
2. run the transformer once more on the clean chunk at ``t = 0`` and keep the cache that now holds it.

Classifier-free guidance keeps a second cache for the negative prompt (its activations differ). The text
is encoded by the pipeline's own ``encode_prompt``, and the whole latent video is decoded by its VAE at the
end (Wan's VAE is causal in time, so this is what decoding chunk by chunk would give, in one call). Any
length works whose latent frames the chunks divide, past the frames the model was trained on; the
factorised memory stays the same size throughout (``StreamOutput.cache_bytes``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from mhla_gen.errors import ConfigError
from mhla_gen.integration.streaming import WanStreamCache, check_streaming_model, stream_step
from mhla_gen.processors.config import MHLAConfig
from mhla_gen.processors.wan_causal import check_chunk_grid, fixed_length

from . import SampleSettings
from .wan import WanSampler, check_wan_size


@dataclass
class StreamOutput:
    """``frames``: the videos as the pipeline returns them (``output_type``); ``latents``: the whole
    latent video ``(B, C, F, h, w)``; ``cache_bytes``: the bytes the caches held after each chunk was
    written (every cache: the negative prompt's too)."""

    frames: object
    latents: torch.Tensor
    cache_bytes: list[int]


def check_stream_settings(mhla: MHLAConfig | None, transformer_config: dict, frames: int, height: int,
                          width: int, temporal: int = 4, spatial: int = 8) -> int:
    """The latent frames of a streamed video of ``frames`` frames at ``height x width`` pixels, from the
    transformer's ``config.json`` (and its ``mhla`` entry) and the VAE's factors; ConfigError naming the
    setting for a bidirectional model, a size the VAE and patch do not tile (:func:`check_wan_size`), or a
    length the chunks (or, general mixing, the blocks) do not fit."""
    if mhla is None or mhla.chunk_frames is None:
        what = "stock attention" if mhla is None else f"bidirectional MHLA (blocks {list(mhla.blocks)})"
        raise ConfigError(f"--stream needs a block-causal model (installed with chunk_frames); this "
                          f"transformer runs {what} (docs/streaming.md: fine-tune one with "
                          f"mhla.chunk_frames=...)")
    if (frames - 1) % temporal:
        raise ConfigError(f"--frames {frames} must be {temporal}k + 1")
    check_wan_size(transformer_config, height, width, spatial)
    latent_frames = (frames - 1) // temporal + 1
    _, ph, pw = transformer_config["patch_size"]
    grid = (latent_frames, height // (spatial * ph), width // (spatial * pw))
    if latent_frames % mhla.chunk_frames:
        raise ConfigError(f"--frames {frames}: its {latent_frames} latent frames are not a whole number "
                          f"of chunks of chunk_frames={mhla.chunk_frames}; use "
                          f"{temporal}·(k·chunk_frames - 1) + 1")
    try:
        check_chunk_grid(mhla, grid)
    except ValueError as err:
        raise ConfigError(f"--frames {frames}, --height {height}, --width {width}: {err}") from None
    return latent_frames


@torch.no_grad()
def _denoise_chunk(transformer, caches: dict, noise, embeds: dict, scheduler, steps: int, guidance: float,
                   progress) -> torch.Tensor:
    """One chunk from its ``noise`` ``(B, C, cf, h, w)`` (fp32) to clean latents: ``steps`` scheduler steps,
    the transformer reading ``caches`` (``{"cond": ..., "uncond": ...}``, unchanged)."""
    scheduler.set_timesteps(steps, device=noise.device)
    latents, dtype = noise, transformer.dtype
    for t in scheduler.timesteps:
        timestep = t.expand(latents.shape[0])
        predictions = {
            name: stream_step(transformer, cache, latents.to(dtype), timestep, embeds[name])[0]
            for name, cache in caches.items()
        }
        prediction = predictions["cond"]
        if "uncond" in predictions:
            prediction = predictions["uncond"] + guidance * (prediction - predictions["uncond"])
        latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
        progress.update()
    return latents


@torch.no_grad()
def _write_chunk(transformer, caches: dict, latents, embeds: dict) -> dict:
    """The caches with the clean chunk ``latents`` written in: the transformer on it at ``t = 0``."""
    timestep = torch.zeros(latents.shape[0], device=latents.device)
    return {name: stream_step(transformer, cache, latents.to(transformer.dtype), timestep, embeds[name])[1]
            for name, cache in caches.items()}


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass


@torch.no_grad()
def stream_chunks(transformer, embeds: dict, count: int, shape: tuple[int, ...], scheduler, steps: int,
                  guidance: float = 1.0, generator=None, progress=None):
    """Stream ``count`` chunks of latents from a block-causal Wan transformer, one at a time.

    Args:
        embeds: ``{"cond": text (B, L, D)}``, plus ``"uncond"`` for guidance > 1 (a second cache).
        shape: one chunk's latents ``(B, C, chunk_frames, h, w)``; its noise is drawn from ``generator``
            in fp32, chunk after chunk.
        scheduler: copied fresh for every chunk (no state across chunks); ``steps`` steps a chunk.
        progress: anything with ``update()`` (a tqdm bar), called once per denoising step.
    Yields:
        ``(clean chunk (B, C, chunk_frames, h, w), bytes the caches hold once it is written)``; after the
        last chunk, whose cache no chunk reads, the bytes are None.
    """
    mhla = check_streaming_model(transformer)
    frames = count * mhla.chunk_frames if fixed_length(mhla) else None
    caches = {name: WanStreamCache.empty(transformer, shape[0], shape[-2:], frames) for name in embeds}
    progress = progress if progress is not None else _NoProgress()
    for index in range(count):
        noise = randn_tensor(shape, generator=generator, device=transformer.device, dtype=torch.float32)
        fresh = type(scheduler).from_config(scheduler.config)
        chunk = _denoise_chunk(transformer, caches, noise, embeds, fresh, steps, guidance, progress)
        if index + 1 == count:  # the last chunk has no successor to read it
            yield chunk, None
            return
        caches = _write_chunk(transformer, caches, chunk, embeds)
        yield chunk, sum(cache.nbytes for cache in caches.values())


def decode(pipe, latents: torch.Tensor, output_type: str = "np"):
    """The videos of normalised Wan latents ``(B, C, F, h, w)``, as ``WanPipeline`` decodes them."""
    vae = pipe.vae
    latents = latents.to(vae.device, vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents)
    video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
    return pipe.video_processor.postprocess_video(video, output_type=output_type)


def _steps_per_chunk(steps) -> int:
    """``steps`` as an int >= 1 (a numpy or other integer type too: ``operator.index``); ValueError for a
    bool, a float, or fewer than one step."""
    try:
        count = None if isinstance(steps, bool) else operator.index(steps)
    except TypeError:
        count = None
    if count is None or count < 1:
        raise ValueError(f"num_inference_steps must be an int >= 1 (steps per chunk), got {steps!r}")
    return count


@torch.no_grad()
def stream_video(pipe, prompt: str | list[str], negative_prompt: str | list[str] | None = None,
                 num_frames: int = 81, height: int = 480, width: int = 832, num_inference_steps: int = 8,
                 guidance_scale: float = 5.0, generator=None, max_sequence_length: int = 512,
                 output_type: str = "np") -> StreamOutput:
    """Stream one video per prompt from a ``WanPipeline`` whose transformer is block-causal
    (:func:`stream_chunks` on the pipeline's text encoder, scheduler and VAE).

    Args:
        pipe: a ``WanPipeline`` (one transformer; Wan2.2's two experts are not streamed).
        num_frames: ``4k + 1`` frames whose latent frames are a whole number of chunks; any length.
        num_inference_steps: denoising steps per chunk.
        guidance_scale: classifier-free guidance (> 1: a second cache for ``negative_prompt``).
        generator, max_sequence_length, output_type: as ``WanPipeline``.
    Raises:
        ValueError / ConfigError: before any work, for a bidirectional model, two experts, fewer than one
            step, or a size or length the VAE, patch and chunks do not tile.
    """
    transformer = pipe.transformer
    mhla = check_streaming_model(transformer)
    num_inference_steps = _steps_per_chunk(num_inference_steps)
    if getattr(pipe, "transformer_2", None) is not None:
        raise ValueError("streaming runs one transformer; this pipeline has two experts (transformer_2)")
    frames = check_stream_settings(mhla, dict(transformer.config), num_frames, height, width,
                                   pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial)
    device = transformer.device
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    cfg = guidance_scale > 1.0
    cond, uncond = pipe.encode_prompt(prompts, negative_prompt, do_classifier_free_guidance=cfg,
                                      max_sequence_length=max_sequence_length, device=device)
    embeds = {"cond": cond.to(transformer.dtype), **({"uncond": uncond.to(transformer.dtype)} if cfg else {})}
    spatial = pipe.vae_scale_factor_spatial
    shape = (len(prompts), transformer.config.in_channels, mhla.chunk_frames, height // spatial,
             width // spatial)
    count = frames // mhla.chunk_frames
    chunks, cache_bytes = [], []
    with pipe.progress_bar(total=count * num_inference_steps) as progress:
        for chunk, nbytes in stream_chunks(transformer, embeds, count, shape, pipe.scheduler,
                                           num_inference_steps, guidance_scale, generator, progress):
            chunks.append(chunk)
            cache_bytes += [nbytes] if nbytes is not None else []
    latents = torch.cat(chunks, dim=2)
    video = latents if output_type == "latent" else decode(pipe, latents, output_type)
    return StreamOutput(video, latents, cache_bytes)


class WanStreamSampler(WanSampler):
    """``mhla-gen sample --base wan --stream``: :func:`stream_video` per prompt, ``--steps`` per chunk,
    any ``--frames`` the chunks divide."""

    @classmethod
    def fit_size(cls, pipe, settings: SampleSettings) -> SampleSettings:
        """:meth:`WanSampler.fit_size` (sizes, ``4k + 1`` frames), then :func:`check_stream_settings`."""
        fitted = super().fit_size(pipe, settings)
        transformer = pipe.transformer
        check_stream_settings(getattr(transformer, "mhla_config", None), dict(transformer.config),
                              fitted.frames, fitted.height, fitted.width, pipe.vae_scale_factor_temporal,
                              pipe.vae_scale_factor_spatial)
        return fitted

    @classmethod
    def sample(cls, pipe, conditions, generator, settings: SampleSettings) -> list[np.ndarray]:
        """The videos ``(F, H, W, 3)`` in [0, 1], one per prompt in ``conditions``."""
        optional = settings.optional(max_sequence_length="max_sequence_length")
        output = stream_video(pipe, list(conditions), settings.negative_prompt, settings.frames,
                              settings.height, settings.width, settings.steps, settings.guidance,
                              generator, output_type=settings.output_type or "np", **optional)
        return list(output.frames)


__all__ = ["StreamOutput", "WanStreamSampler", "check_stream_settings", "decode", "stream_chunks",
           "stream_video"]
