"""Training objectives: DiT's DDPM loss with learned sigma, and SANA/Wan rectified flow matching.

DDPM (DiT, from guided-diffusion's ``training_losses`` with ``learn_sigma=True``, ``LossType.MSE``):

    loss = mean((ε - ε_θ)²) + L_vb
    L_vb = KL(q(x_{t-1} | x_t, x_0) ‖ p_θ(x_{t-1} | x_t)) / log 2        t > 0   (bits per dim)
         = -log p_θ(x_0 | x_1) / log 2  (discretised Gaussian)          t = 0

The variance head ``v`` interpolates log-variances, ``log σ² = f log β_t + (1 - f) log β̃_t`` with
``f = (v + 1) / 2`` (``learned_range``, the same rule as diffusers' DDPMScheduler), and L_vb sees the
mean through ``ε_θ.detach()`` so it only trains the variance head. Schedule tensors come from
diffusers' ``DDPMScheduler``; the terms below are the few lines the scheduler does not expose.
"""

from __future__ import annotations

import math

import torch


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
