"""Rectified flow matching as a training objective (:class:`FlowMatching`): SANA's and Wan's, with diffusion
forcing for block-causal video models.

The model sees ``x_σ = (1 - σ) x0 + σ ε`` at ``timestep = σ · T`` and predicts the velocity ``ε - x0``; the
loss is the mean squared error, each item's weighted by ``flow.loss_weighting`` at its σ (diffusers' SD3 /
SANA training loss). σ comes from the ``flow.weighting`` density, shifted by ``flow.shift`` (else the
checkpoint scheduler's shift) and mapped into the trained expert's noise range (Wan2.2, ``experts.py``).

Diffusion forcing (``flow.per_chunk_noise``, ``docs/streaming.md``): a streaming model (``mhla.chunk_frames``)
makes each chunk of a video conditioned on the chunks before it. Trained with one noise level for the whole
video, it only ever sees past chunks as noisy as the present one; at sampling time the past is clean. So
every chunk of every training video draws its own σ (the same density, shift and expert range), is noised
at it, gets a per-token timestep (``WanTransformer3DModel`` takes ``(B, N)``), and weighs its loss by its own
σ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import ConfigError
from ..config import FlowMatchingConfig
from ..experts import in_expert_range
from .base import ModelFacts, Objective


def flow_matching_sigmas(
    rnd, weighting: str, logit_mean: float, logit_std: float, mode_scale: float, shift: float
) -> torch.Tensor:
    """σ ∈ (0, 1) per sample (B,), SD3/SANA densities, then the scheduler's shift σ' = sσ / (1 + (s - 1)σ).

    Draws go through ``rnd`` (a :class:`StepRandom`), so they do not depend on the process count.
    """
    if weighting == "logit_normal":
        u = torch.sigmoid(rnd.normal(logit_mean, logit_std))
    elif weighting == "mode":
        u = rnd.rand()
        u = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    elif weighting == "uniform":
        u = rnd.rand()
    else:
        raise ValueError(f"flow.weighting must be logit_normal, mode or uniform, got {weighting!r}")
    u = u.clamp(1e-5, 1.0 - 1e-5)
    return shift * u / (1.0 + (shift - 1.0) * u)


def flow_matching_inputs(
    x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor, num_train_timesteps: int
) -> dict[str, torch.Tensor]:
    """Rectified flow (FlowMatchEulerDiscreteScheduler convention): the model sees x_σ = (1 - σ) x0 + σ ε
    at ``timestep = σ · T``. x0, noise: ``(B, C, ...)`` latents; sigmas ``(B,)``."""
    s = sigmas.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return {"hidden_states": (1.0 - s) * x0 + s * noise, "timestep": sigmas * num_train_timesteps}


def per_chunk_flow_inputs(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor,
                          num_train_timesteps: int, chunk_frames: int,
                          patch_size: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """Diffusion forcing: :func:`flow_matching_inputs` with a σ per chunk of ``chunk_frames`` latent frames.
    x0, noise ``(B, C, F, H, W)``; sigmas ``(B, F / chunk_frames)``. The timestep is Wan's per-token form
    ``(B, N)`` (every token of chunk c at ``σ_c · T``; ``WanTransformer3DModel`` takes a ``(B, N)`` timestep),
    tokens in the transformer's ``(f h w)`` order for a patch ``(1, ph, pw)``."""
    batch, frames = x0.shape[0], x0.shape[2]
    if frames % chunk_frames or sigmas.shape != (batch, frames // chunk_frames):
        raise ValueError(f"per-chunk σ {tuple(sigmas.shape)} do not fit {frames} latent frames in chunks of "
                         f"{chunk_frames} (batch {batch})")
    per_frame = sigmas.repeat_interleave(chunk_frames, dim=1)  # (B, F)
    s = per_frame.view(batch, 1, frames, 1, 1).to(x0.dtype)
    tokens_per_frame = (x0.shape[3] // patch_size[1]) * (x0.shape[4] // patch_size[2])
    timestep = (per_frame * num_train_timesteps).repeat_interleave(tokens_per_frame, dim=1)  # (B, N)
    return {"hidden_states": (1.0 - s) * x0 + s * noise, "timestep": timestep}


def flow_matching_loss_weights(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """The loss weight of each sample (B,) at its σ, ``flow.loss_weighting``: diffusers'
    ``compute_loss_weighting_for_sd3`` (``sigma_sqrt``: σ⁻², ``cosmap``: 2 / (π (1 - 2σ + 2σ²)); ``none``:
    ones)."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    return compute_loss_weighting_for_sd3(scheme, sigmas.float()).float()


def flow_matching_mse(
    prediction: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The model predicts the velocity v = ε - x0; mean squared error in fp32, each sample's error times
    its weight ``weights`` (B,) where given (diffusers' SD3 / SANA training loss), or each element's times
    ``weights`` broadcast to the error (e.g. ``(B, 1, F, 1, 1)``: a weight per latent frame, per-chunk σ)."""
    error = (prediction.float() - (noise - x0).float()) ** 2
    if weights is None:
        return error.mean()
    if weights.dim() == 1:
        weights = weights.view(-1, *([1] * (error.ndim - 1)))
    return (weights * error).mean()


def flow_matching_loss(
    model, x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor, num_train_timesteps: int, **cond
) -> torch.Tensor:
    """:func:`flow_matching_mse` of ``model`` at :func:`flow_matching_inputs`."""
    inputs = flow_matching_inputs(x0, noise, sigmas, num_train_timesteps)
    prediction = model(**inputs, return_dict=False, **cond)[0]
    return flow_matching_mse(prediction, x0, noise)


@dataclass(frozen=True)
class FlowNoise:
    """The σ, noised inputs and loss weights of a run.

    Attributes:
        flow: the run's ``flow`` section (σ density, shift override, loss weighting).
        shift, boundary_ratio, expert: the σ shift and the expert's σ range (``experts.py``).
        num_train_timesteps: the scheduler's (timestep = σ · T).
        chunk_frames, patch_size: diffusion forcing's chunks (latent frames) and the transformer's patch
            ``(1, ph, pw)``; None: one σ per item.
    """

    flow: object
    shift: float
    boundary_ratio: float | None
    expert: str
    num_train_timesteps: int
    chunk_frames: int | None = None
    patch_size: tuple[int, int, int] | None = None

    def draw(self, rnd) -> torch.Tensor:
        """σ ``(B,)``: the ``flow.weighting`` density, shifted, in the expert's range."""
        f = self.flow
        sigmas = flow_matching_sigmas(rnd, f.weighting, f.logit_mean, f.logit_std, f.mode_scale, self.shift)
        return in_expert_range(sigmas, self.boundary_ratio, self.expert)

    def sigmas(self, rnd, latents: torch.Tensor) -> torch.Tensor:
        """``(B,)``, or with chunks one draw per chunk of ``latents`` ``(B, C, F, h, w)``:
        ``(B, F / chunk_frames)``, in chunk order."""
        if self.chunk_frames is None:
            return self.draw(rnd)
        return torch.stack([self.draw(rnd) for _ in range(latents.shape[2] // self.chunk_frames)], dim=1)

    def inputs(self, x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> dict:
        """``hidden_states`` at σ (each chunk at its own) and the ``timestep`` (per token with chunks)."""
        if self.chunk_frames is None:
            return flow_matching_inputs(x0, noise, sigmas, self.num_train_timesteps)
        return per_chunk_flow_inputs(x0, noise, sigmas, self.num_train_timesteps, self.chunk_frames,
                                     self.patch_size)

    def loss_weights(self, sigmas: torch.Tensor) -> torch.Tensor | None:
        """``flow.loss_weighting`` at σ: None (``none``), ``(B,)``, or per latent frame ``(B, 1, F, 1, 1)``
        with chunks (each chunk's weight at its own σ)."""
        scheme = self.flow.loss_weighting
        if scheme == "none":
            return None
        weights = flow_matching_loss_weights(scheme, sigmas)
        if self.chunk_frames is None:
            return weights
        return weights.repeat_interleave(self.chunk_frames, dim=1)[:, None, :, None, None]


class FlowMatching(Objective):
    """Rectified flow matching with the ``flow`` section's σ density, shift, loss weighting and per-chunk
    noise (:class:`FlowNoise`)."""

    name, section, settings = "flow", "flow", FlowMatchingConfig

    def __init__(self, noise: FlowNoise):
        self.noise = noise

    @classmethod
    def check(cls, settings: FlowMatchingConfig, facts: ModelFacts) -> None:
        """``flow.per_chunk_noise`` only for a block-causal model."""
        if settings.per_chunk_noise and facts.chunk_frames is None:
            raise ConfigError("flow.per_chunk_noise=true (diffusion forcing) needs block-causal attention: "
                              "set mhla.chunk_frames (latent frames per chunk) with model.attention=mhla")

    @classmethod
    def build(cls, settings: FlowMatchingConfig, facts: ModelFacts) -> FlowMatching:
        """``flow.shift``, else the scheduler's (``shift`` or ``flow_shift``, else 1); its timestep count;
        the expert's range; with per-chunk noise the chunks and the transformer's patch."""
        scheduler = facts.scheduler
        shift = settings.shift
        if shift is None:
            shift = float(scheduler.get("shift", None) or scheduler.get("flow_shift", None) or 1.0)
        chunks = facts.chunk_frames if settings.per_chunk_noise else None
        patch = tuple(facts.transformer()["patch_size"]) if chunks else None
        return cls(FlowNoise(settings, shift, facts.boundary_ratio, facts.expert,
                             scheduler["num_train_timesteps"], chunks, patch))

    def draw(self, rnd, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas, noise)``: σ ``(B,)`` (or ``(B, chunks)``), then ε like one item."""
        return self.noise.sigmas(rnd, latents), rnd.randn(*latents.shape[1:])

    def noised(self, x0: torch.Tensor, draws: tuple) -> tuple[dict, tuple]:
        """``x_σ`` at ``timestep = σ · T``; the target ``(x0, noise, sigmas)``."""
        sigmas, noise = draws
        return self.noise.inputs(x0, noise, sigmas), (x0, noise, sigmas)

    def loss(self, prediction: torch.Tensor, target: tuple) -> torch.Tensor:
        x0, noise, sigmas = target
        return flow_matching_mse(prediction, x0, noise, self.noise.loss_weights(sigmas))
