"""MHLA attention processors, one module per base model (dit, sana, wan), and the registry of them.

Each processor class says which diffusers transformer it serves and how it is installed into it
(class attributes and class methods declared on :class:`MHLAProcessor`); ``install_mhla``, save/load,
LoRA loading and the attention statistics look a model's processor class up here.
"""

from __future__ import annotations

from torch import nn

from .base import MHLAProcessor
from .dit import DiTMHLAProcessor
from .sana import SanaMHLAProcessor
from .sana_video import SanaVideoMHLAProcessor
from .wan import WanMHLAProcessor

PROCESSOR_CLASSES: tuple[type[MHLAProcessor], ...] = (
    DiTMHLAProcessor, SanaMHLAProcessor, WanMHLAProcessor, SanaVideoMHLAProcessor
)
"""The supported base models, one MHLA processor class each: DiT, SANA, Wan (2.1 / 2.2) and SANA-Video."""


def _supported() -> list[str]:
    return [processor.model_cls.__name__ for processor in PROCESSOR_CLASSES]


def processor_class_for(transformer: nn.Module) -> type[MHLAProcessor]:
    """The MHLA processor class whose ``model_cls`` ``transformer`` is an instance of."""
    for processor in PROCESSOR_CLASSES:
        if isinstance(transformer, processor.model_cls):
            return processor
    raise ValueError(f"MHLA does not support {type(transformer).__name__}; supported models: {_supported()}")


def processor_class_for_name(class_name: str) -> type[MHLAProcessor]:
    """The MHLA processor class for a diffusers class name, as written in ``config.json["_class_name"]``."""
    for processor in PROCESSOR_CLASSES:
        if processor.model_cls.__name__ == class_name:
            return processor
    raise ValueError(f"MHLA does not support model class {class_name!r}; supported models: {_supported()}")


__all__ = [
    "PROCESSOR_CLASSES",
    "DiTMHLAProcessor",
    "MHLAProcessor",
    "SanaMHLAProcessor",
    "SanaVideoMHLAProcessor",
    "WanMHLAProcessor",
    "processor_class_for",
    "processor_class_for_name",
]
