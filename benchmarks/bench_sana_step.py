"""One SANA-1.6B denoising step at 1024 px: stock linear attention against MHLA, in ms per step.

    python benchmarks/bench_sana_step.py --device cuda                 # SANA-1.6B, 1024 px, batch 2, bf16
    python benchmarks/bench_sana_step.py --device cuda --compile       # both models torch.compile'd
    python benchmarks/bench_sana_step.py --tiny --device cpu --batch 1 --reps 2   # plumbing (tests)

The model: ``SanaTransformer2DModel`` with SANA-1.6B's config, the ``SanaMS_1600M_P1_D20`` entry of
diffusers' own conversion script (huggingface/diffusers ``scripts/convert_sana_to_diffusers.py``,
``--image_size 1024``): 20 layers, 70 heads x 32 (hidden 2240), cross-attention 20 heads x 112, caption
channels 2304 (Gemma-2-2B), mlp ratio 2.5, patch 1, no attention bias, norm eps 1e-6 without affine
parameters, 32 latent channels; random weights, cast as ``from_pretrained(..., torch_dtype=...)`` casts
them (``mhla_gen.integration.serialization.cast_like_diffusers``). 1024 px through SANA's DC-AE (32x) is a 32
x 32 latent: 1024 tokens. Two copies of one random model: ``stock`` keeps diffusers' SANA processor (global
ReLU linear attention), ``mhla`` gets ``install_mhla(MHLAConfig.preset("sana"))`` (4 x 4 blocks).
``--tiny``: ``mhla_gen.testing.TINY_SANA_CONFIG`` (a 16 x 16 latent).

What is measured: one transformer forward under ``torch.inference_mode()`` (a sampler's denoising step
without the text encoder, VAE or scheduler), batch 2 by default (classifier-free guidance's two branches),
text features (B, 300, 2304) (SANA pads prompts to 300 tokens). Timing as ``bench_dit_step.py``
(``step_timing.py``): warm-up, then interleaved repetitions; median ms per step, the median of
per-repetition speed-ups over stock, peak memory (CUDA). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from diffusers import SanaTransformer2DModel

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_timing beside this file

from step_timing import StepBench, parse_step_args, step_main, timed_report  # noqa: E402

from mhla_gen import MHLAConfig, install_mhla  # noqa: E402
from mhla_gen.commands.cli import run as run_cli  # noqa: E402
from mhla_gen.integration.serialization import cast_like_diffusers  # noqa: E402

# diffusers scripts/convert_sana_to_diffusers.py: model_kwargs["SanaMS_1600M_P1_D20"] and the shared
# transformer_kwargs at --image_size 1024 (sample_size 1024 // 32, interpolation_scale None)
SANA_1600M_1024_CONFIG = dict(
    in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
    num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
    caption_channels=2304, mlp_ratio=2.5, attention_bias=False, sample_size=32, patch_size=1,
    norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None,
)
TEXT_TOKENS = 300
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BENCH = StepBench(
    script="bench_sana_step.py", step="denoising step (random weights, inference)", reference="stock",
    batch=2, batch_help="latents per step (2: CFG's two branches)",
    tiny_help="mhla_gen.testing.TINY_SANA_CONFIG (tests)", precision="--dtype",
    precision_choices=tuple(sorted(DTYPES)), precision_default=("bf16", "fp32"),
    precision_help="default: bf16 on CUDA, else fp32",
)


def parse_args(argv=None) -> argparse.Namespace:
    return parse_step_args(BENCH, __doc__, argv)


def build_models(config: dict, device: torch.device, dtype) -> dict[str, SanaTransformer2DModel]:
    """``{variant: model}`` in eval mode: one random model (built on ``device``), MHLA in a copy."""
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of a minute for 1.6 B parameters
        base = SanaTransformer2DModel(**config)
    base = cast_like_diffusers(base.to(device).eval(), dtype)
    side = config["sample_size"] // config["patch_size"]
    blocks = tuple(min(b, side) for b in MHLAConfig.preset("sana").blocks)
    mhla = install_mhla(copy.deepcopy(base), MHLAConfig.preset("sana", blocks=blocks))
    return {"stock": base, "mhla": mhla}


def make_inputs(config: dict, batch: int, device, dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    side = config["sample_size"]
    return dict(
        hidden_states=torch.randn(batch, config["in_channels"], side, side, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, config["caption_channels"], generator=g).to(
            device, dtype),
        timestep=torch.full((batch,), 500.0, device=device),
        return_dict=False,
    )


def run(args) -> dict:
    dtype = DTYPES[args.dtype]
    if args.tiny:
        from mhla_gen.testing import TINY_SANA_CONFIG

        config = dict(TINY_SANA_CONFIG)
    else:
        config = dict(SANA_1600M_1024_CONFIG)
    models = build_models(config, args.device, dtype)
    inputs = make_inputs(config, args.batch, args.device, dtype)
    steps = {}
    for name, model in models.items():
        runner = torch.compile(model) if args.compile else model

        def step(runner=runner):
            with torch.inference_mode():
                runner(**inputs)

        steps[name] = step
    title = "tiny SANA (TINY_SANA_CONFIG)" if args.tiny else "SANA-1.6B 1024 px"
    return timed_report(BENCH, steps, args, title, config)


def main(argv=None) -> dict:
    return step_main(BENCH, parse_args(argv), argv, run)


if __name__ == "__main__":
    run_cli(main)
