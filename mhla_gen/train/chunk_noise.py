"""Where diffusion forcing's noise (``flow.per_chunk_noise``) lived before the objectives became components:
:class:`FlowNoise` and the flow-matching inputs are in :mod:`mhla_gen.train.objectives.flow` now; this module
keeps ``from mhla_gen.train.chunk_noise import FlowNoise`` working."""

from .objectives.flow import FlowNoise, flow_matching_inputs, per_chunk_flow_inputs

__all__ = ["FlowNoise", "flow_matching_inputs", "per_chunk_flow_inputs"]
