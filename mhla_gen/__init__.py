"""MHLA: Multi-Head Linear Attention for image and video diffusion (arXiv 2601.07832)."""

from .analysis import attention_matrix, attention_rank, compare_attention, row_entropy
from .extras import ConvPositionEncoding, OutputGate
from .layout import BlockLayout
from .mixing import MixingMatrix, clamp_mixing_, locality_init
from .ops import MHLADecodeState, mhla_attention, mhla_decode_step

__version__ = "0.1.0"

__all__ = [
    "BlockLayout",
    "ConvPositionEncoding",
    "MHLADecodeState",
    "MixingMatrix",
    "OutputGate",
    "attention_matrix",
    "attention_rank",
    "clamp_mixing_",
    "compare_attention",
    "locality_init",
    "mhla_attention",
    "mhla_decode_step",
    "row_entropy",
]
