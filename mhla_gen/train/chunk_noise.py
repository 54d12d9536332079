"""How a flow-matching run noises its latents (``flow.*``): one σ per item, or one per chunk of a video
(diffusion forcing, ``flow.per_chunk_noise``, for block-causal models; ``docs/streaming.md``).

A streaming model (``mhla.chunk_frames``) makes each chunk of a video conditioned on the chunks before it.
Trained with one noise level for the whole video, it only ever sees past chunks as noisy as the present
one; at sampling time the past is clean. Diffusion forcing draws an independent σ for every chunk of
every training video (the run's σ density, shift and expert range, chunk by chunk), noises each chunk at
its own σ, gives the transformer a per-token timestep (``WanTransformer3DModel`` takes ``(B, N)``), and
weighs each chunk's loss by its own σ (``flow.loss_weighting``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .attention import attention_mhla_config
from .experts import in_expert_range
from .objectives import (
    flow_matching_inputs,
    flow_matching_loss_weights,
    flow_matching_sigmas,
    per_chunk_flow_inputs,
)


def check_streaming(task, transformer_config: dict) -> None:
    """Block-causal attention (``mhla.chunk_frames``) only where ``task``'s base runs it, and
    ``flow.per_chunk_noise`` only with it: ConfigError naming the setting, before any work."""
    mhla = attention_mhla_config(*task.attention())
    if mhla is not None:
        try:
            task.base.processor.check_config(mhla, transformer_config)
        except ValueError as err:
            raise ConfigError(f"mhla: {err}") from None
    if task.cfg.flow.per_chunk_noise and (mhla is None or mhla.chunk_frames is None):
        raise ConfigError("flow.per_chunk_noise=true (diffusion forcing) needs block-causal attention: set "
                          "mhla.chunk_frames (latent frames per chunk; model.attention=mhla, or softmax "
                          "for block-causal softmax)")


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

    @classmethod
    def for_task(cls, task) -> FlowNoise:
        """A :class:`~mhla_gen.train.finetune.FlowFinetuneTask`'s (after its ``setup``: the scheduler)."""
        flow, frozen = task.cfg.flow, task.frozen
        chunks = attention_mhla_config(*task.attention()).chunk_frames if flow.per_chunk_noise else None
        patch = tuple(task.model_configs()[0]["patch_size"]) if chunks else None
        return cls(flow, task.shift, frozen.config.get("boundary_ratio"), task.cfg.model.expert,
                   frozen.scheduler.config.num_train_timesteps, chunks, patch)

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
