"""MHLA: Multi-Head Linear Attention for image and video diffusion (arXiv 2601.07832)."""

from .analysis import attention_matrix, attention_rank, compare_attention, row_entropy
from .config import MHLAConfig
from .extras import ConvPositionEncoding, OutputGate
from .install import install_mhla, mhla_parameters, uninstall_mhla
from .layout import BlockLayout
from .loading import load_transformer
from .mixing import MixingMatrix, clamp_mixing_, locality_init
from .models import MHLADiTTransformer2DModel, MHLASanaTransformer2DModel, MHLAWanTransformer3DModel
from .ops import MHLADecodeState, mhla_attention, mhla_decode_step
from .serialization import load_mhla_parameters, save_mhla_parameters

__version__ = "0.1.0"

__all__ = [
    "BlockLayout",
    "ConvPositionEncoding",
    "MHLAConfig",
    "MHLADiTTransformer2DModel",
    "MHLASanaTransformer2DModel",
    "MHLAWanTransformer3DModel",
    "MHLADecodeState",
    "MixingMatrix",
    "OutputGate",
    "attention_matrix",
    "attention_rank",
    "clamp_mixing_",
    "compare_attention",
    "install_mhla",
    "load_mhla_parameters",
    "load_transformer",
    "locality_init",
    "mhla_attention",
    "mhla_decode_step",
    "mhla_parameters",
    "row_entropy",
    "save_mhla_parameters",
    "uninstall_mhla",
]
