"""The learnable factorised mixing of streaming MHLA: ``W[i, j] = W_s[s(i), s(j)] · γ_h^(t(i) - t(j))``.

``W_s`` (m x m) mixes the blocks of one chunk; ``γ_h`` (one per head) discounts each chunk further back
(``mhla_gen/ops/streaming.py``, ``docs/streaming.md``). Neither depends on the video's length, so a model
trained on short clips streams any number of chunks with a cache of constant size.

Parameterisation (no clamp after the optimizer step, unlike :class:`~mhla_gen.ops.mixing.MixingMatrix`):

    W_s = softplus(spatial_raw)       > 0, initialised at the locality init (entries floored at 1e-4)
    γ_h = sigmoid(decay_logit_h)      in (0, 1), initialised at ``decay_init``

The decay is kept below 1 by construction (a sigmoid); the functional API (``factorised_block_causal_mhla``,
``FactorisedStreamCache.step``) takes any ``γ`` in (0, 1], including 1 (no decay: SANA-Video's running sum).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layout import BlockLayout
from .mixing import locality_init

SPATIAL_FLOOR = 1e-4  # softplus cannot reach 0: the locality init's zero entries start here
LOGIT_MIN = -30.0  # γ >= sigmoid(-30) ≈ 1e-13: stays > 0 in float32


def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


class FactorisedMixing(nn.Module):
    """``(W_s (m, m), γ (H,))`` of one layer, for the blocks of ``chunk_layout`` and ``heads`` heads.

    Args:
        chunk_layout: the block layout of one chunk, ``(chunk_frames, H, W)``.
        heads: attention heads (one decay each).
        decay_init: initial ``γ`` of every head, in (0, 1).
        rule, normalize, temperature: the spatial init (:func:`~mhla_gen.ops.mixing.locality_init`).
    """

    def __init__(self, chunk_layout: BlockLayout, heads: int, decay_init: float = 0.9, rule: str = "linear",
                 normalize: str = "row", temperature: float = 1.0):
        super().__init__()
        if not 0 < decay_init < 1:
            raise ValueError(f"decay_init must lie in (0, 1) (the learnt decay is a sigmoid), got "
                             f"{decay_init}")
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        spatial = locality_init(chunk_layout, rule, normalize, temperature).double().clamp_min(SPATIAL_FLOOR)
        self.spatial_raw = nn.Parameter(_inverse_softplus(spatial).float())
        self.decay_logit = nn.Parameter(torch.full((heads,), math.log(decay_init / (1 - decay_init))))

    @property
    def num_blocks(self) -> int:
        return self.spatial_raw.shape[0]

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_s (m, m) >= 0, γ (H,) in (0, 1))``, differentiable in both parameters."""
        return F.softplus(self.spatial_raw), torch.sigmoid(self.decay_logit.clamp_min(LOGIT_MIN))

    def extra_repr(self) -> str:
        return f"num_blocks={self.num_blocks}, heads={self.decay_logit.shape[0]}"
