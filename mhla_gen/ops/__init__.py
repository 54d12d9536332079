"""MHLA operators: the registered op (``mhla.py``), the plain-autograd path for causal MHLA and callable
feature maps (``autograd_path.py``), the recurrent decoder and the plain references (``naive.py``)."""

from .autograd_path import mhla_attention_autograd
from .feature_maps import FEATURE_MAPS, get_feature_map
from .mhla import Saved, mhla_attention
from .naive import linear_attention, mhla_block_loop, mhla_dense, mhla_dense_weights
from .recurrent import MHLADecodeState, mhla_decode_step

__all__ = [
    "FEATURE_MAPS",
    "MHLADecodeState",
    "Saved",
    "get_feature_map",
    "linear_attention",
    "mhla_attention",
    "mhla_attention_autograd",
    "mhla_block_loop",
    "mhla_decode_step",
    "mhla_dense",
    "mhla_dense_weights",
]
