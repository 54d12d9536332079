"""MHLA operators: the registered op and its backend switch (``mhla.py``), the plain-autograd path for
causal MHLA and callable feature maps (``autograd_path.py``), the recurrent decoder and the plain
references (``naive.py``)."""

from .autograd_path import mhla_attention_autograd
from .feature_maps import FEATURE_MAPS, get_feature_map
from .mhla import BACKENDS, Saved, get_mhla_backend, mhla_attention, mhla_backend
from .naive import linear_attention, mhla_block_loop, mhla_dense, mhla_dense_weights
from .recurrent import MHLADecodeState, mhla_decode_step

__all__ = [
    "BACKENDS",
    "FEATURE_MAPS",
    "MHLADecodeState",
    "Saved",
    "get_feature_map",
    "get_mhla_backend",
    "linear_attention",
    "mhla_attention",
    "mhla_attention_autograd",
    "mhla_backend",
    "mhla_block_loop",
    "mhla_decode_step",
    "mhla_dense",
    "mhla_dense_weights",
]
