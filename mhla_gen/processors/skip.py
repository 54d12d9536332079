"""What diffusers' layer-skip hooks need from the MHLA processors (``diffusers.hooks.layer_skip``).

``apply_layer_skip`` (and the guiders built on it: ``SkipLayerGuidance``, ``PerturbedAttentionGuidance``,
``AutoGuidance``) has two ways of skipping a self-attention without skipping its whole block:

* ``skip_attention=True, skip_ff=False``: the attention module returns its input. diffusers looks up
  what "its input" is by the processor's class in ``AttentionProcessorRegistry`` and refuses a class it
  does not know; every MHLA processor class registers itself there when it is defined
  (:func:`register_skip_output`, called by ``MHLAProcessor.__init_subclass__``).
* ``skip_attention_scores=True`` (perturbed attention): the layer runs under a torch function mode that
  makes ``scaled_dot_product_attention`` return V (identity attention). MHLA calls no SDPA, so it would
  run unchanged; the processors ask :func:`attention_scores_skipped` and use V as the attention output,
  the rest of the layer (CPE, gate, head norm, ``to_out``) as usual.
"""

from __future__ import annotations

import torch

# diffusers' registry and function mode are private; pyproject pins diffusers to 0.42.x, where they are these
from diffusers.hooks._helpers import AttentionProcessorMetadata, AttentionProcessorRegistry
from diffusers.hooks.layer_skip import AttentionScoreSkipFunctionMode


def skipped_attention_output(attn, *args, **kwargs) -> torch.Tensor:
    """What a skipped self-attention returns: its ``hidden_states`` input (as diffusers does for its own
    self-attention processors; their function of that name is private, hence this copy)."""
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def register_skip_output(processor_cls: type) -> None:
    """Tell diffusers' layer skip what a skipped attention running ``processor_cls`` returns."""
    AttentionProcessorRegistry.register(
        processor_cls, AttentionProcessorMetadata(skip_processor_output_fn=skipped_attention_output)
    )


def attention_scores_skipped() -> bool:
    """Whether this call runs under diffusers' ``skip_attention_scores`` (the attention output is V).
    ``torch.compile`` traces the check (it guards on the function mode stack)."""
    return any(isinstance(mode, AttentionScoreSkipFunctionMode)
               for mode in torch.overrides._get_current_function_mode_stack())
