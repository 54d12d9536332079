"""DDPM as a training objective (:class:`DDPM`): DiT's loss, with or without a learned variance.

The loss (DiT, from guided-diffusion's ``training_losses`` with ``learn_sigma=True``, ``LossType.MSE``):

    loss = mean((ε - ε_θ)²) + L_vb
    L_vb = KL(q(x_{t-1} | x_t, x_0) ‖ p_θ(x_{t-1} | x_t)) / log 2        t > 0   (bits per dim)
         = -log p_θ(x_0 | x_1) / log 2  (discretised Gaussian)          t = 0

The variance head ``v`` interpolates log-variances, ``log σ² = f log β_t + (1 - f) log β̃_t`` with
``f = (v + 1) / 2`` (``learned_range``, the same rule as diffusers' DDPMScheduler), and L_vb sees the
mean through ``ε_θ.detach()`` so it only trains the variance head. Schedule tensors come from
diffusers' ``DDPMScheduler``; the terms below are the few lines the scheduler does not expose. Without a
learned variance the loss is the ε MSE alone. ``diffusion.snr_gamma`` weights the ε term by
min(SNR, γ) / SNR (Min-SNR-γ).

The objective draws an integer timestep ``t`` per item and ε, and gives the transformer
``x_t = sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) ε`` (``DDPMScheduler.add_noise``) at ``timestep = t``.
"""

from __future__ import annotations

import math

import torch
from diffusers import DDPMScheduler

from ..config import DiffusionConfig
from .base import ModelFacts, Objective


def _mean_flat(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


def normal_kl(mean1, logvar1, mean2, logvar2) -> torch.Tensor:
    """KL(N(mean1, e^logvar1) ‖ N(mean2, e^logvar2)), elementwise."""
    return 0.5 * (
        -1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2)
    )


def _approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def discretized_gaussian_log_likelihood(x, means, log_scales) -> torch.Tensor:
    """Log-likelihood of data in [-1, 1] in 256 bins under N(means, e^(2 log_scales)), elementwise."""
    centered = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = _approx_standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = _approx_standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_cdf_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))


class DDPMLoss:
    """DiT's hybrid loss on a diffusers ``DDPMScheduler`` schedule.

    Args:
        scheduler: the training ``DDPMScheduler`` (betas, alphas_cumprod, add_noise).
        learn_sigma: the model outputs ``2C`` channels (ε and the variance interpolation ``v``).
    """

    def __init__(self, scheduler, learn_sigma: bool = True, snr_gamma: float | None = None):
        self.scheduler = scheduler
        self.learn_sigma = learn_sigma
        betas = scheduler.betas.double()
        ac = scheduler.alphas_cumprod.double()
        ac_prev = torch.cat([ac.new_ones(1), ac[:-1]])
        post_var = betas * (1.0 - ac_prev) / (1.0 - ac)
        tables = {
            "post_log_var": torch.log(torch.cat([post_var[1:2], post_var[1:]])),  # clipped at t = 0
            "log_betas": torch.log(betas),
            "coef_x0": betas * ac_prev.sqrt() / (1.0 - ac),
            "coef_xt": (1.0 - ac_prev) * (1.0 - betas).sqrt() / (1.0 - ac),
            "sqrt_recip_ac": (1.0 / ac).sqrt(),
            "sqrt_recipm1_ac": (1.0 / ac - 1.0).sqrt(),
            # Min-SNR-γ weight of the ε term, min(SNR, γ) / SNR (1 everywhere when off)
            "eps_weight": (ac / (1.0 - ac)).clamp(max=snr_gamma) / (ac / (1.0 - ac)) if snr_gamma
            else torch.ones_like(ac),
        }
        self.tables = {k: v.float() for k, v in tables.items()}

    @property
    def num_timesteps(self) -> int:
        return len(self.scheduler.betas)

    def _at(self, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Table entries for timesteps ``t`` (B,), shaped (B, 1, ..., 1) like ``like``. The tables move to
        ``like``'s device once (the first call there), not on every lookup."""
        if self.tables[name].device != like.device:
            self.tables = {k: v.to(like.device) for k, v in self.tables.items()}
        return self.tables[name][t].view(-1, *([1] * (like.ndim - 1)))

    def __call__(
        self,
        model_output: torch.Tensor,
        x0: torch.Tensor,
        xt: torch.Tensor,
        noise: torch.Tensor,
        t: torch.Tensor,
    ) -> torch.Tensor:
        """Scalar loss. model_output ``(B, 2C or C, ...)``; x0, xt, noise ``(B, C, ...)``; t ``(B,)`` long."""
        model_output, x0, xt, noise = model_output.float(), x0.float(), xt.float(), noise.float()
        weight = self._at("eps_weight", t, noise).flatten()
        if not self.learn_sigma:
            return (weight * _mean_flat((noise - model_output) ** 2)).mean()
        channels = x0.shape[1]
        if model_output.shape[1] != 2 * channels:
            raise ValueError(f"learn_sigma needs {2 * channels} output channels, got {model_output.shape[1]}")
        eps, var_values = model_output[:, :channels], model_output[:, channels:]
        mse = weight * _mean_flat((noise - eps) ** 2)

        # variational bound; the mean is frozen so L_vb only trains the variance head
        eps = eps.detach()
        frac = (var_values + 1.0) / 2.0
        model_log_var = frac * self._at("log_betas", t, x0) + (1.0 - frac) * self._at("post_log_var", t, x0)
        pred_x0 = self._at("sqrt_recip_ac", t, x0) * xt - self._at("sqrt_recipm1_ac", t, x0) * eps
        model_mean = self._at("coef_x0", t, x0) * pred_x0 + self._at("coef_xt", t, x0) * xt
        true_mean = self._at("coef_x0", t, x0) * x0 + self._at("coef_xt", t, x0) * xt
        kl = _mean_flat(normal_kl(true_mean, self._at("post_log_var", t, x0), model_mean, model_log_var))
        nll = -_mean_flat(discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * model_log_var))
        vb = torch.where(t == 0, nll, kl) / math.log(2.0)
        return (mse + vb).mean()


class DDPM(Objective):
    """DDPM on the ``diffusion`` section's schedule (DiT's by default: linear betas, 1000 steps); with a
    learned variance when the model outputs one (:meth:`ModelFacts.outputs_variance`).

    Attributes:
        scheduler: the training ``DDPMScheduler`` (``variance_type`` learned_range / fixed_small); the
            sampling schedulers of DiT's grids are built from its config.
        terms: the loss (:class:`DDPMLoss`).
    """

    name, section, settings = "ddpm", "diffusion", DiffusionConfig

    def __init__(self, scheduler: DDPMScheduler, learn_sigma: bool, snr_gamma: float | None = None):
        self.scheduler = scheduler
        self.terms = DDPMLoss(scheduler, learn_sigma, snr_gamma)

    @classmethod
    def build(cls, settings: DiffusionConfig, facts: ModelFacts) -> DDPM:
        learn_sigma = facts.outputs_variance()
        scheduler = DDPMScheduler(
            num_train_timesteps=settings.num_train_timesteps,
            beta_schedule=settings.beta_schedule,
            beta_start=settings.beta_start,
            beta_end=settings.beta_end,
            clip_sample=False,
            variance_type="learned_range" if learn_sigma else "fixed_small",
        )
        return cls(scheduler, learn_sigma, settings.snr_gamma)

    def draw(self, rnd, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(t, noise)``: ``t`` ``(B,)`` uniform over the training timesteps, then ε like one item."""
        t = rnd.randint(self.terms.num_timesteps)
        return t, rnd.randn(*latents.shape[1:])

    def noised(self, x0: torch.Tensor, draws: tuple) -> tuple[dict, tuple]:
        """``x_t`` at timestep ``t``; the target ``(x0, x_t, noise, t)`` (:class:`DDPMLoss`'s arguments)."""
        t, noise = draws
        xt = self.scheduler.add_noise(x0, noise, t)
        return {"hidden_states": xt, "timestep": t}, (x0, xt, noise, t)

    def loss(self, prediction: torch.Tensor, target: tuple) -> torch.Tensor:
        return self.terms(prediction, *target)
