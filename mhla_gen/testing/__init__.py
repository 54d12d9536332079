"""Tiny models and pipelines for tests and smoke runs (seconds on CPU, no downloads), one module per family:
DiT and SANA and the :class:`TinyBase` test reference every base record names (``tiny.py``), Wan
(``wan.py``), SANA-Video and Wan2.2 (``video.py``). The names of ``tiny.py`` are handed on here."""

from .tiny import (
    OFFLOAD_MODES,
    TINY_DIT,
    TINY_DIT_CONFIG,
    TINY_SANA,
    TINY_SANA_CONFIG,
    TINY_VOCAB,
    TinyBase,
    caption_forward_kwargs,
    dit_forward,
    dit_forward_kwargs,
    offload,
    on_model,
    sample_dit,
    sample_sana,
    sana_forward,
    tiny_autoencoder_dc,
    tiny_autoencoder_kl,
    tiny_dit,
    tiny_dit_pipeline,
    tiny_gemma2,
    tiny_sana,
    tiny_sana_pipeline,
    tiny_tokenizer,
)

__all__ = [
    "OFFLOAD_MODES", "TINY_DIT", "TINY_DIT_CONFIG", "TINY_SANA", "TINY_SANA_CONFIG", "TINY_VOCAB", "TinyBase",
    "caption_forward_kwargs", "dit_forward", "dit_forward_kwargs", "offload", "on_model", "sample_dit",
    "sample_sana", "sana_forward", "tiny_autoencoder_dc", "tiny_autoencoder_kl", "tiny_dit",
    "tiny_dit_pipeline", "tiny_gemma2", "tiny_sana", "tiny_sana_pipeline", "tiny_tokenizer",
]
