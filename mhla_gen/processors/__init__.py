"""MHLA attention processors, one module per base model (dit, sana, wan, sana_video).

Each processor class says which diffusers transformer it serves and how it is installed into it (class
attributes and class methods declared on :class:`MHLAProcessor`). Which processor a model gets is a
question for its base record: ``mhla_gen.bases.base_for_model(transformer).processor``.
"""

from __future__ import annotations

from .base import MHLAProcessor
from .dit import DiTMHLAProcessor
from .sana import SanaMHLAProcessor
from .sana_video import SanaVideoMHLAProcessor
from .wan import WanMHLAProcessor

__all__ = [
    "DiTMHLAProcessor", "MHLAProcessor", "SanaMHLAProcessor", "SanaVideoMHLAProcessor", "WanMHLAProcessor"
]
