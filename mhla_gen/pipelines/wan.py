"""A stock diffusers ``WanPipeline`` whose transformer runs MHLA self-attention.

    pipe = load_wan_pipeline("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", transformer_path="runs/wan-mhla/final")
    frames = pipe("a cat surfing", height=480, width=832, num_frames=81).frames[0]

Three ways to get the MHLA transformer, in this order:

1. ``transformer_path``: a folder written by ``transformer.save_pretrained`` after ``install_mhla``
   (fine-tuning output, or ``scripts/convert_wan_mhla.py`` for the released checkpoint);
2. ``path_or_id/transformer`` when that local folder was saved with MHLA (a whole saved pipeline);
3. otherwise the stock pretrained transformer, with ``mhla`` installed fresh (untrained mixing: a
   starting point for fine-tuning, not a sampler that will produce good videos).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

from mhla_gen.config import MHLAConfig

from . import load_pipeline_transformer


def load_wan_pipeline(
    path_or_id,
    mhla: MHLAConfig | None = None,
    torch_dtype: torch.dtype = torch.bfloat16,
    device=None,
    transformer_path=None,
    vae_dtype: torch.dtype = torch.float32,
) -> WanPipeline:
    """Load a ``WanPipeline`` with an MHLA transformer.

    Args:
        path_or_id: a diffusers Wan pipeline folder or hub id (text encoder, tokenizer, VAE, scheduler).
        mhla: MHLA to install on a stock transformer. Must be None (or equal) when the transformer was
            saved with MHLA: a fresh install would throw the trained MHLA weights away.
        torch_dtype: dtype of the transformer and text encoder.
        device: where to move the pipeline (None: stay on CPU).
        transformer_path: a saved MHLA transformer folder to use instead of ``path_or_id/transformer``.
        vae_dtype: the Wan VAE is usually run in float32, as the Wan examples in diffusers do.
    Returns:
        the pipeline; ``pipe.transformer.mhla_config`` tells which MHLA it runs (None: stock softmax).
    Raises:
        ValueError: ``mhla`` conflicts with the MHLA the transformer was saved with, or the saved
            transformer is not a ``WanTransformer3DModel``.
    """
    transformer = load_pipeline_transformer(
        WanTransformer3DModel, path_or_id, mhla, torch_dtype, transformer_path
    )
    vae = AutoencoderKLWan.from_pretrained(path_or_id, subfolder="vae", dtype=vae_dtype)
    pipe = WanPipeline.from_pretrained(path_or_id, transformer=transformer, vae=vae, dtype=torch_dtype)
    return pipe.to(device) if device is not None else pipe
