"""Training objectives: the components a training task trains with, one per base record's ``objective``.

A base record names its objective class (``Base.objective``, a :class:`~mhla_gen.bases.Ref`); the task
builds it from the run config's section of that objective (:attr:`Objective.section`) and what it knows of
the model (:class:`ModelFacts`), and calls it every micro-step (:class:`Objective`: ``draw``, ``noised``,
``loss``):

- :class:`DDPM` (``ddpm.py``, section ``diffusion``): DiT's DDPM, with or without a learned variance;
- :class:`FlowMatching` (``flow.py``, section ``flow``): rectified flow matching (SANA, Wan), its σ
  density, shift, loss weighting and per-chunk noise (diffusion forcing).

The math each uses sits beside it (DiT's variational bound, the flow-matching inputs and weights).
"""

from .base import ModelFacts, Objective, objective_settings
from .ddpm import DDPM, DDPMLoss, discretized_gaussian_log_likelihood, normal_kl
from .flow import (
    FlowMatching,
    FlowNoise,
    flow_matching_inputs,
    flow_matching_loss,
    flow_matching_loss_weights,
    flow_matching_mse,
    flow_matching_sigmas,
    per_chunk_flow_inputs,
)

__all__ = [
    "DDPM",
    "DDPMLoss",
    "FlowMatching",
    "FlowNoise",
    "ModelFacts",
    "Objective",
    "discretized_gaussian_log_likelihood",
    "flow_matching_inputs",
    "flow_matching_loss",
    "flow_matching_loss_weights",
    "flow_matching_mse",
    "flow_matching_sigmas",
    "normal_kl",
    "objective_settings",
    "per_chunk_flow_inputs",
]
