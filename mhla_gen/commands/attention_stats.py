"""Per-layer rank and mean row entropy of a saved transformer's self-attention maps (JSON + PNG).

    mhla-gen attention-stats --model runs/dit_digits/final --digits
    mhla-gen attention-stats --model runs/sana/final --size 16 --batch 2 --out-dir runs/sana/attn

The model folder is anything ``load_transformer`` reads (saved with or without MHLA). Inputs are noised
latents at --timestep (DDPM linear schedule): the embedded digits with --digits (pixel-space 1-channel
models), held-out drawn shapes with --shapes (pixel-space 3-channel models), pure noise otherwise. On an
image grid each layer also reports its mirror mass (attention on the horizontally mirrored token). Maps
are N × N per head, so N (tokens per layer) must stay small.
Output: ``attention_stats.json`` and ``.png`` in ``--out-dir`` (default: ``attention_stats/`` beside the
model folder when that lies in a training run of mhla_gen, e.g. ``runs/x/final``, whose folder rule knows
it; a model anywhere else, such as a pipeline's ``transformer/``, needs ``--out-dir``); the folder must be
new, empty or one this script wrote (mhla_gen.outputs.folders).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mhla_gen.commands.cli import expand_path, run
from mhla_gen.data.digits import digits_tensors
from mhla_gen.data.shapes import HELD_OUT_SEED, shapes_tensors
from mhla_gen.errors import ConfigError
from mhla_gen.integration.loading import check_weight_files, load_transformer
from mhla_gen.metrics.attention import (
    attention_statistics,
    example_inputs,
    save_attention_statistics,
)
from mhla_gen.outputs.folders import adopt_command, check_apart, claim, owned, read_marker

STATS_FOLDER = "attention_stats"  # the kind of folder --out-dir is (mhla_gen.outputs.folders.KINDS)


def digits_batch(batch: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` seeded digits ``(B, 1, size, size)`` in [-1, 1] and their labels."""
    images, labels = digits_tensors(size)
    pick = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))[:batch]
    return images[pick] * 2 - 1, labels[pick]


def shapes_batch(batch: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` held-out drawn shapes ``(B, 3, size, size)`` in [-1, 1] (every class in turn) and labels."""
    images, labels = shapes_tensors(size, batch, seed=HELD_OUT_SEED + seed)
    return images * 2 - 1, labels


def default_out_dir(model: str) -> Path:
    """``attention_stats/`` beside the model folder, when the folder holding it is a training run of ours
    (``runs/x/final``); elsewhere (a pipeline's ``transformer/``, a folder of the user's) that would write
    into a folder that is not ours and holds an input, so ``--out-dir`` must be given."""
    folder = Path(model)
    if not folder.is_dir():
        raise FileNotFoundError(f"--model {model!r} is not a folder (a saved transformer)")
    parent = folder.resolve().parent
    if (read_marker(parent) or {}).get("kind") != "run":
        raise ConfigError(
            f"--out-dir not given, and its default {str(parent / STATS_FOLDER)!r} lies in {str(parent)!r}, "
            f"which holds --model and is not a training run of mhla_gen; nothing was written: pass --out-dir "
            f"(a run of an earlier version without markers: list it first: {adopt_command('run', parent)})"
        )
    return parent / STATS_FOLDER


# --digits / --shapes: the pixel channels the model must have, and the batch it is fed
DATA_BATCHES = {"digits": (1, digits_batch), "shapes": (3, shapes_batch)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=expand_path,
                        help="transformer folder (save_pretrained / final/)")
    parser.add_argument("--out-dir", default=None, type=expand_path,
                        help="default: MODEL/../attention_stats when MODEL lies in a training run")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=None, help="latent size (default: model sample_size)")
    parser.add_argument("--frames", type=int, default=3, help="latent frames (Wan)")
    parser.add_argument("--timestep", type=int, default=500)
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--digits", action="store_true", help="noise real digits instead of pure noise")
    data.add_argument("--shapes", action="store_true", help="noise held-out drawn shapes instead")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("batch", "frames", "max_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.size is not None and args.size < 1:
        raise ConfigError(f"--size must be >= 1, got {args.size}")
    if not 0 <= args.timestep < 1000:
        raise ConfigError(f"--timestep must be in 0..999, got {args.timestep}")
    out_dir = Path(args.out_dir) if args.out_dir else default_out_dir(args.model)
    check_apart(out_dir, "--out-dir", {"--model": args.model})  # before any work
    check_weight_files(args.model, f"--model {args.model}")
    owned(out_dir, STATS_FOLDER, "--out-dir")

    model = load_transformer(args.model)
    images = labels = None
    data = "digits" if args.digits else "shapes" if args.shapes else None
    if data:
        channels, draw = DATA_BATCHES[data]
        if model.config.in_channels != channels:
            raise ValueError(f"--{data} needs a {channels}-channel pixel-space model, {args.model!r} has "
                             f"in_channels={model.config.in_channels}")
        images, labels = draw(args.batch, args.size or model.config.sample_size, args.seed)
    kwargs = example_inputs(model, args.batch, args.size, args.frames, args.timestep, images, labels,
                            args.seed)
    stats = attention_statistics(model, lambda: model(**kwargs), max_tokens=args.max_tokens)

    claim(out_dir, STATS_FOLDER, "--out-dir")
    save_attention_statistics(stats, out_dir / "attention_stats.json", out_dir / "attention_stats.png",
                              title=f"{Path(args.model).name} (t={args.timestep})")
    print(json.dumps(stats, indent=2))
    return stats


if __name__ == "__main__":
    run(main)
