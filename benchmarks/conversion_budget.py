"""What converting a pretrained model to MHLA costs, from the model shapes (no GPU, no weights).

    python benchmarks/conversion_budget.py

For DiT-XL/2 at 256 px, SANA-600M at 1024 px and Wan2.1-1.3B at 480x832x81, built on the ``meta``
device (shapes only), torch's ``FlopCounterMode`` counts the floating-point operations of

* one **training step** of the MHLA model per sample (forward + backward, every parameter trained), and
* one **stage-1 step** per sample (``mhla_gen.train.transfer``): the teacher's forward plus, in every
converted
  layer, the MHLA student's forward and the backward its loss needs, for ``trainable=mhla`` and ``all``.

Counts come from ``mhla_gen.metrics.flops`` (which teaches FlopCounterMode the MHLA op and grouped convolution
backward): FLOPs (2 per multiply-add) of the matmul-like ops; elementwise work is not counted.
"""

from __future__ import annotations

import argparse

import torch
from diffusers import DiTTransformer2DModel, SanaTransformer2DModel, WanTransformer3DModel

from mhla_gen import MHLAConfig, install_mhla
from mhla_gen.commands.cli import run
from mhla_gen.metrics.flops import count_flops
from mhla_gen.train.transfer import TransferHooks

# DiT paper Table 1; SANA-600M (Efficient-Large-Model/Sana_600M_1024px_diffusers); Wan2.1-T2V-1.3B
# (diffusers scripts/convert_wan_to_diffusers.py)
MODELS = {
    "DiT-XL/2 256 px": (
        DiTTransformer2DModel,
        dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
             sample_size=32, patch_size=2, num_embeds_ada_norm=1000),
        MHLAConfig.preset("dit-256"),
    ),
    "SANA-600M 1024 px": (
        SanaTransformer2DModel,
        dict(in_channels=32, out_channels=32, num_attention_heads=36, attention_head_dim=32, num_layers=28,
             num_cross_attention_heads=16, cross_attention_head_dim=72, cross_attention_dim=1152,
             caption_channels=2304, sample_size=32, patch_size=1),
        MHLAConfig.preset("sana"),
    ),
    "Wan2.1-1.3B 480p 81 frames": (
        WanTransformer3DModel,
        dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
             out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
             qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
        MHLAConfig.preset("wan2.1-1.3b-480p"),
    ),
}


def inputs(cls, config: dict, batch: int = 1) -> tuple[tuple, dict]:
    """Meta-device inputs of one sample at the model's real size."""
    if cls is DiTTransformer2DModel:
        s = config["sample_size"]
        return (torch.empty(batch, 4, s, s),), dict(timestep=torch.zeros(batch, dtype=torch.long),
                                                    class_labels=torch.zeros(batch, dtype=torch.long))
    if cls is SanaTransformer2DModel:
        s = config["sample_size"]
        return (torch.empty(batch, 32, s, s),), dict(encoder_hidden_states=torch.empty(batch, 300, 2304),
                                                     timestep=torch.zeros(batch))
    return (torch.empty(batch, 16, 21, 60, 104), torch.zeros(batch), torch.empty(batch, 512, 4096)), {}


def count(fn) -> int:
    return count_flops(fn)


def budget(name: str) -> dict:
    """FLOPs per sample: the teacher's forward, an MHLA training step, stage-1 steps."""
    cls, config, mhla = MODELS[name]
    with torch.device("meta"):
        model = cls(**config)
        args, kwargs = inputs(cls, config)
    teacher = count(lambda: model(*args, **kwargs, return_dict=False))
    install_mhla(model, mhla)
    row = {"teacher forward": teacher, "training step": count(lambda: training_step(model, args, kwargs))}
    for trainable in ("mhla", "all"):
        hooks = TransferHooks(model, trainable)
        for p in model.parameters():
            p.requires_grad_(False)
        for p in hooks.parameters():
            p.requires_grad_(True)
        row[f"stage 1 ({trainable})"] = count(lambda hooks=hooks: stage1_step(model, hooks, args, kwargs))
        hooks.remove()
    return row


def training_step(model, args, kwargs) -> None:
    model(*args, **kwargs, return_dict=False)[0].float().square().mean().backward()


def stage1_step(model, hooks, args, kwargs) -> None:
    model(*args, **kwargs, return_dict=False)
    sum(hooks.pop_errors().values()).backward()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    print("| model | teacher forward | MHLA training step | stage 1, trainable=mhla | stage 1, "
          "trainable=all |")
    print("|---|---|---|---|---|")
    for name in MODELS:
        r = budget(name)
        step = r["training step"]
        cells = [f"{r['teacher forward'] / 1e12:.2f} TFLOP", f"{step / 1e12:.2f} TFLOP"] + [
            f"{r[k] / 1e12:.2f} TFLOP ({r[k] / step:.2f} step)" for k in ("stage 1 (mhla)", "stage 1 (all)")
        ]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    run(main)
