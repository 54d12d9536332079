"""The ``mhla-gen`` subcommands: one module each with ``main(argv)`` (its own argparse ``--help``).

``mhla-gen NAME ARGS``, ``python -m mhla_gen NAME ARGS`` and the checkout's ``python scripts/<name>.py
ARGS`` / ``python eval/<name>.py ARGS`` run the same ``main`` (:func:`mhla_gen.commands.cli.main` dispatches).
Nothing here imports a command: listing them must not load torch's training or metric stacks.
"""

from __future__ import annotations

from typing import NamedTuple


class Command(NamedTuple):
    module: str  # imported when the command runs; its main(argv) does the work
    summary: str  # the line `mhla-gen --help` shows
    script: str | None = None  # the checkout's script that runs the same main


COMMANDS = {
    "train-dit": Command("mhla_gen.commands.train_dit", "train a class-conditional DiT (default: the digits "
                         "main job)", "scripts/train_dit.py"),
    "finetune-sana": Command("mhla_gen.commands.finetune_sana", "fine-tune a pretrained SANA into MHLA",
                             "scripts/finetune_sana.py"),
    "finetune-sana-video": Command("mhla_gen.commands.finetune_sana_video",
                                   "fine-tune a pretrained SANA-Video into MHLA",
                                   "scripts/finetune_sana_video.py"),
    "finetune-wan": Command("mhla_gen.commands.finetune_wan", "fine-tune a pretrained Wan2.1 / 2.2 into MHLA",
                            "scripts/finetune_wan.py"),
    "finetune-wan-i2v": Command("mhla_gen.commands.finetune_wan_i2v",
                                "fine-tune a pretrained Wan image-to-video model into MHLA",
                                "scripts/finetune_wan_i2v.py"),
    "linearize": Command("mhla_gen.commands.linearize", "stage 1 of converting a pretrained model: "
                         "attention transfer, hybrid layers", "scripts/linearize.py"),
    "convert-wan": Command("mhla_gen.commands.convert_wan", "convert the released Wan-MHLA checkpoint into a "
                           "diffusers folder", "scripts/convert_wan_mhla.py"),
    "extract-latents": Command("mhla_gen.commands.extract_latents", "encode an image class folder into a DiT "
                               "latent cache", "scripts/extract_latents.py"),
    "sample": Command("mhla_gen.commands.sample", "sample images or videos through the stock diffusers "
                      "pipelines", "scripts/sample.py"),
    "generate": Command("mhla_gen.commands.generate", "generate an evaluation sample set (files + manifest)",
                        "eval/generate.py"),
    "fid": Command("mhla_gen.commands.fid", "score images: FID, sFID, KID, IS, precision, recall",
                   "eval/fid.py"),
    "vbench": Command("mhla_gen.commands.vbench", "score videos: VBench-style dimensions", "eval/vbench.py"),
    "attention-stats": Command("mhla_gen.commands.attention_stats", "per-layer attention rank and entropy "
                               "of a saved transformer", "eval/attention_stats.py"),
    "adopt": Command("mhla_gen.commands.adopt", "adopt a folder an older mhla_gen wrote (checks content)"),
    "configs": Command("mhla_gen.commands.configs", "list the shipped configs, or print one's path"),
}
