"""MHLA: Multi-Head Linear Attention for image and video diffusion (arXiv 2601.07832)."""

from .integration.install import install_mhla, mhla_parameters, uninstall_mhla
from .integration.loading import load_transformer
from .integration.serialization import load_mhla_parameters, save_mhla_parameters
from .metrics.attention_maps import attention_matrix, attention_rank, compare_attention, row_entropy
from .models import MHLADiTTransformer2DModel, MHLASanaTransformer2DModel, MHLAWanTransformer3DModel
from .ops import MHLADecodeState, mhla_attention, mhla_decode_step
from .ops.layout import BlockLayout
from .ops.mixing import MixingMatrix, clamp_mixing_, locality_init
from .processors.config import MHLAConfig
from .processors.extras import ConvPositionEncoding, OutputGate

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
