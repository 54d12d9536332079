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

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

from mhla_gen.config import MHLAConfig
from mhla_gen.install import CONFIG_KEY, install_mhla, is_mhla_installed
from mhla_gen.serialization import load_transformer


def _saved_with_mhla(folder: Path) -> bool:
    config = folder / "config.json"
    return config.is_file() and CONFIG_KEY in json.loads(config.read_text())


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
        ValueError: ``mhla`` conflicts with the MHLA the transformer was saved with.
    """
    local = Path(path_or_id)
    saved = Path(transformer_path) if transformer_path is not None else local / "transformer"
    if transformer_path is not None or (local.is_dir() and _saved_with_mhla(saved)):
        transformer = load_transformer(saved, torch_dtype=torch_dtype)
    else:
        transformer = WanTransformer3DModel.from_pretrained(
            path_or_id, subfolder="transformer", dtype=torch_dtype
        )

    if mhla is not None:
        if is_mhla_installed(transformer) and transformer.mhla_config != mhla:
            raise ValueError(
                f"the transformer at {saved} was saved with {transformer.mhla_config}; refusing to replace "
                f"its trained MHLA with {mhla} (pass mhla=None to use the saved one)"
            )
        if not is_mhla_installed(transformer):
            install_mhla(transformer, mhla)

    vae = AutoencoderKLWan.from_pretrained(path_or_id, subfolder="vae", dtype=vae_dtype)
    pipe = WanPipeline.from_pretrained(path_or_id, transformer=transformer, vae=vae, dtype=torch_dtype)
    return pipe.to(device) if device is not None else pipe
