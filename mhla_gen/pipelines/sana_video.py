"""A stock diffusers ``SanaVideoPipeline`` whose transformer runs MHLA self-attention (``attn1``).

    pipe = load_sana_video_pipeline("Efficient-Large-Model/SANA-Video_2B_480p_diffusers",
                                    transformer_path="runs/sana-video-mhla/final", torch_dtype=torch.bfloat16)
    video = pipe("a cat surfing", height=480, width=832, frames=81).frames[0]

A fresh install that should start exactly at the stock model (conversion, fine-tuning): uniform mixing
and SANA-Video's epsilon divided by the number of blocks,
``MHLAConfig(blocks=(3, 5, 10), mixing_init="uniform", eps=SANA_VIDEO_EPS / 150)``.
Pass ``use_resolution_binning=False`` for sizes outside SANA-Video's aspect-ratio bins (tiny test
models, or an exact resolution), and ``complex_human_instruction=None`` with a tokenizer that is not Gemma's.
"""

from __future__ import annotations

import torch
from diffusers import SanaVideoPipeline, SanaVideoTransformer3DModel

from mhla_gen.config import MHLAConfig

from . import load_pipeline_transformer


def load_sana_video_pipeline(
    path_or_id,
    mhla: MHLAConfig | None = None,
    torch_dtype: torch.dtype = torch.bfloat16,
    device=None,
    transformer_path=None,
    vae_dtype: torch.dtype = torch.float32,
) -> SanaVideoPipeline:
    """Load a ``SanaVideoPipeline`` with an MHLA transformer.

    Args:
        path_or_id: a diffusers SANA-Video pipeline folder or hub id (Gemma2 text encoder, tokenizer, Wan
            VAE, scheduler).
        mhla: MHLA to install on a stock transformer; None (or equal) when it was saved with MHLA.
        torch_dtype: dtype of the transformer and text encoder.
        device: where to move the pipeline (None: stay on CPU).
        transformer_path: a saved MHLA transformer folder (e.g. a fine-tuning run's ``final/``) to use
            instead of ``path_or_id/transformer``.
        vae_dtype: the VAE (Wan's at 480p) runs in float32, as diffusers' SANA-Video examples do.
    Returns:
        the pipeline; ``pipe.transformer.mhla_config`` tells which MHLA it runs (absent: stock SANA-Video).
    """
    transformer = load_pipeline_transformer(
        SanaVideoTransformer3DModel, path_or_id, mhla, torch_dtype, transformer_path
    )
    dtypes = {"default": torch_dtype, "vae": vae_dtype}  # whichever VAE class the folder names
    pipe = SanaVideoPipeline.from_pretrained(path_or_id, transformer=transformer, dtype=dtypes)
    return pipe.to(device) if device is not None else pipe
