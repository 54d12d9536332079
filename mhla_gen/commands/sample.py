r"""Sample images (DiT, SANA) or videos (Wan) from an MHLA model with the stock diffusers pipelines.

    mhla-gen sample --base dit --model runs/dit/pipeline --labels 1 2 3 --steps 50 --guidance 4
    mhla-gen sample --base dit --model PIPE_DIR --transformer runs/dit/final --labels 0 1
    mhla-gen sample --base sana --model SANA_DIR --transformer runs/sana/final \
        --prompt "a red cat" "a blue dog" --height 512 --width 512 --dtype bf16 --device cuda
    mhla-gen sample --base wan --model WAN_DIR --transformer runs/wan/final \
        --prompt "a cat surfing" --height 480 --width 832 --frames 81 --dtype bf16 --device cuda
    mhla-gen sample --base wan-i2v --model WAN_I2V_DIR --transformer runs/wan-i2v/final \
        --prompt "a cat surfing" "a dog running" --image cat.png dog.png --dtype bf16 --device cuda
    mhla-gen sample --base wan --model WAN_DIR --transformer runs/wan-stream/final --stream \
        --prompt "a cat surfing" --frames 161 --steps 8 --dtype bf16 --device cuda

``--model`` is a diffusers pipeline folder (or hub id) providing VAE, scheduler and text encoder;
``--transformer`` an MHLA transformer saved with ``save_pretrained`` (default: ``--model``'s own).
Writes ``<out>/<base>_seed<seed>_grid.png`` plus one PNG per image, or one MP4 per prompt for video bases.
What each base takes (labels or prompts, sizes) and how its pipeline is called is its record's
(``mhla_gen.bases``; the sampling call: ``mhla_gen.pipelines.<base>``). Image-to-video bases take one
``--image`` per prompt (or one for all prompts): the first frame of each video.
``--stream`` (Wan, a block-causal model: MHLA with ``chunk_frames``) generates chunk by chunk with the
model's cache, ``--steps`` per chunk, any ``--frames`` whose latent frames the chunks divide
(``mhla_gen.pipelines.wan_stream``, docs/streaming.md).
``--out`` must be new, empty or a folder this script wrote; files of an earlier call with the same names
are replaced only with ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from PIL import Image

from mhla_gen.bases import BASES, base_for
from mhla_gen.commands.cli import device_setting, expand_path, run
from mhla_gen.errors import ConfigError
from mhla_gen.integration.install import is_mhla_installed
from mhla_gen.integration.loading import check_weight_files
from mhla_gen.integration.lora import is_lora_folder, lora_mhla_config
from mhla_gen.outputs.folders import check_apart, claim, owned
from mhla_gen.pipelines import SampleSettings
from mhla_gen.pipelines.checks import check_sampling
from mhla_gen.pipelines.conditions import check_images, pair_images
from mhla_gen.pipelines.wan import WAN_DEFAULT_SIZE
from mhla_gen.pipelines.wan_stream import check_stream_settings
from mhla_gen.processors.config import MHLAConfig

OUTPUT_KIND = "sample_outputs"  # the kind of folder --out is (mhla_gen.outputs.folders.KINDS)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, type=expand_path,
                        help="diffusers pipeline folder or hub id")
    parser.add_argument("--base", required=True, choices=sorted(BASES))
    parser.add_argument("--transformer", default=None, type=expand_path,
                        help="saved MHLA transformer folder (e.g. run/final)")
    parser.add_argument("--blocks", type=int, nargs="+", default=None,
                        help="install fresh MHLA with these blocks into a stock transformer (untrained)")
    parser.add_argument("--labels", type=int, nargs="+", default=None,
                        help="class labels (class-conditional bases: DiT)")
    parser.add_argument("--prompt", nargs="+", default=None, help="prompts (text-conditional bases)")
    parser.add_argument("--image", nargs="+", default=None, type=expand_path,
                        help="first-frame images (image-to-video bases): one per prompt, or one for all")
    parser.add_argument("--negative-prompt", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--height", type=int, default=None,
                        help="pixels (default: the model's size for images, 480 x 832 for Wan)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--frames", type=int, default=81, help="video length (video bases)")
    parser.add_argument("--stream", action="store_true",
                        help="Wan, block-causal model: generate chunk by chunk from its cache, any length")
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="samples", type=expand_path,
                        help="folder: new, empty or one this script wrote")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace files of an earlier call with the same names in --out")
    args = parser.parse_args(argv)

    check_condition_flags(parser, args)
    if args.stream and base_for(args.base).stream_sampler is None:
        streaming = sorted(name for name, base in BASES.items() if base.stream_sampler is not None)
        parser.error(f"--stream is built for --base {' / '.join(streaming)}, not --base {args.base}")
    if args.stream and args.blocks is not None:
        parser.error("--stream samples a trained block-causal transformer; --blocks installs untrained MHLA")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.guidance < 0:
        parser.error(f"--guidance must be >= 0, got {args.guidance}")
    if not 0 <= args.seed < 2**32:  # as training's; the files are named by seed (``seed-1`` otherwise)
        parser.error(f"--seed must be in 0..2**32-1, got {args.seed}")
    if args.blocks is not None:
        try:
            MHLAConfig(blocks=tuple(args.blocks))
        except ValueError as error:
            parser.error(f"--blocks {' '.join(map(str, args.blocks))}: {error}")
    for name in ("height", "width", "frames", "fps"):  # fps 0: imageio silently writes its default rate
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be positive, got {value}")
    try:
        device_setting(args.device)
    except ConfigError as error:
        parser.error(str(error))
    for name in ("model", "transformer"):
        path = getattr(args, name)
        if path is not None and not Path(path).exists() and (name == "transformer" or _looks_local(path)):
            parser.error(f"--{name} {path} does not exist")
    folder = args.transformer
    if folder is not None and not (Path(folder) / "config.json").is_file() and not is_lora_folder(folder):
        pipeline = (Path(folder) / "transformer").is_dir()
        hint = " (a pipeline folder: pass its transformer/)" if pipeline else ""
        parser.error(f"--transformer {folder} is not a saved transformer folder (no config.json){hint}")
    weights = folder or (Path(args.model) / "transformer" if Path(args.model).is_dir() else None)
    if weights is not None:  # a cut download: one line here, not a traceback after the pipeline loaded
        try:
            check_weight_files(weights, f"--transformer {folder}" if folder else f"--model {args.model}")
        except ConfigError as error:
            parser.error(str(error))
    return args


def check_condition_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags the base's conditioning takes: ``--labels``, ``--prompt``, ``--prompt`` + ``--image``."""
    base = base_for(args.base)
    if base.class_conditional and not args.labels:
        parser.error(f"--base {args.base} needs --labels (class ids)")
    if not base.class_conditional and not args.prompt:
        parser.error(f"--base {args.base} needs --prompt")
    if base.class_conditional and args.prompt:
        parser.error(f"--base {args.base} is class-conditional: use --labels, not --prompt")
    if not base.class_conditional and args.labels:
        parser.error(f"--base {args.base} is text-conditional: use --prompt, not --labels")
    if base.image_conditioned and not args.image:
        parser.error(f"--base {args.base} needs --image (one per prompt, or one for all)")
    if args.image and not base.image_conditioned:
        parser.error(f"--base {args.base} takes no --image (not an image-to-video base)")


def _looks_local(path: str) -> bool:
    """A hub id is ``owner/name``; anything else that does not exist is a mistyped local path."""
    return path.startswith((".", "/", "~")) or path.count("/") != 1


def image_grid(images: list[Image.Image], max_cols: int = 8) -> Image.Image:
    """All images on one canvas, ``max_cols`` per row (diffusers' make_image_grid needs a full grid)."""
    cols = min(len(images), max_cols)
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, image in enumerate(images):
        grid.paste(image, box=(i % cols * w, i // cols * h))
    return grid


def settings(args) -> SampleSettings:
    return SampleSettings(steps=args.steps, guidance=args.guidance, height=args.height, width=args.width,
                          frames=args.frames, negative_prompt=args.negative_prompt)


def conditions(args) -> list:
    """The class labels, prompts or ``(prompt, image)`` pairs to sample."""
    base = base_for(args.base)
    if base.image_conditioned:
        return pair_images(args.prompt, args.image, "--image")
    return args.labels if base.class_conditional else args.prompt


def load(args, mhla, dtype):
    """The base's pipeline (its record's sampler, or the streaming one), its labels checked, its size
    fitted."""
    base = base_for(args.base)
    sampler = (base.stream_sampler if args.stream else base.sampler).load()
    pipe = sampler.load(args.model, mhla, dtype, args.device, args.transformer)
    sampler.check_conditions(pipe, conditions(args), args.guidance, trained_classes(args))
    if not is_mhla_installed(pipe.transformer):  # legitimate (a softmax teacher), but never silent
        print(f"{Path(sys.argv[0]).name}: note: the transformer of {args.transformer or args.model} has no "
              "MHLA: sampling the base's own attention (--transformer RUN/final samples a trained MHLA "
              "model, --blocks installs fresh MHLA)", file=sys.stderr)
    return sampler, pipe, sampler.fit_size(pipe, settings(args))


def sample_images(args, loaded) -> list[Image.Image]:
    sampler, pipe, fitted = loaded
    generator = torch.Generator(args.device).manual_seed(args.seed)
    return sampler.sample(pipe, conditions(args), generator, fitted)


def sample_videos(args, loaded, out: Path) -> list[Path]:
    """One MP4 per prompt, prompt ``i`` with seed ``seed + i``."""
    from diffusers.utils import export_to_video

    sampler, pipe, fitted = loaded
    paths = []
    for i, condition in enumerate(conditions(args)):
        generator = torch.Generator(args.device).manual_seed(args.seed + i)
        frames = sampler.sample(pipe, [condition], generator, fitted)[0]
        path = out / output_names(args)[i]
        paths.append(Path(export_to_video(frames, str(path), fps=args.fps)))
    return paths


def trained_classes(args) -> int | None:
    """The classes a class-conditional model was trained on, where its folder records them."""
    sampler = base_for(args.base).sampler.load()
    return sampler.trained_classes(args.transformer or Path(args.model) / "transformer")


def check_labels(args) -> None:
    """Labels against the classes the model was trained on, before anything is loaded."""
    num_classes = trained_classes(args) if args.labels else None
    bad = [label for label in args.labels or [] if num_classes is not None and not 0 <= label < num_classes]
    if bad:
        raise ConfigError(f"--labels {bad}: the model was trained on classes 0..{num_classes - 1}")


def output_names(args) -> list[str]:
    """The files this call writes into ``--out``: one MP4 per prompt (video), or one PNG per image and
    the grid."""
    base = base_for(args.base)
    if base.video:
        return [f"{base.name}_seed{args.seed + i}_{i:02d}.mp4" for i in range(len(args.prompt))]
    names = args.labels if base.class_conditional else range(len(args.prompt))
    images = [f"{args.base}_seed{args.seed}_{i:02d}_{name}.png" for i, name in enumerate(names)]
    return [*images, f"{args.base}_seed{args.seed}_grid.png"]


def check_out(args) -> Path:
    """``--out`` may be claimed (new, empty or written by this script; apart from the inputs), and holds no
    earlier samples with the same names unless ``--overwrite``: checked before any model is loaded, and
    claimed only once the model loaded (a hub id that cannot be fetched leaves no folder behind)."""
    out = Path(args.out)
    images = {f"--image {image}": image for image in args.image or []}
    check_apart(out, "--out", {"--model": args.model, "--transformer": args.transformer, **images})
    owned(out, OUTPUT_KIND, "--out")
    existing = [name for name in output_names(args) if (out / name).exists()]
    if existing and not args.overwrite:
        raise ConfigError(
            f"--out {str(out)!r} already holds {', '.join(existing[:3])}"
            f"{', ...' if len(existing) > 3 else ''} from an earlier call; pass --overwrite to replace "
            f"them, or choose another --seed or --out"
        )
    return out


def saved_transformer_config(args) -> dict:
    """The ``config.json`` of the transformer that will be sampled (``--transformer``, else ``--model``'s),
    without loading weights; a LoRA + MHLA folder contributes its MHLA config."""
    from diffusers import WanTransformer3DModel


    if args.transformer is not None and is_lora_folder(args.transformer):
        config = dict(WanTransformer3DModel.load_config(args.model, subfolder="transformer"))
        mhla = lora_mhla_config(args.transformer)
        return {**config, "mhla": mhla.to_dict() if mhla is not None else None}
    if args.transformer is not None:
        return json.loads((Path(args.transformer) / "config.json").read_text())
    return dict(WanTransformer3DModel.load_config(args.model, subfolder="transformer"))


def check_stream(args) -> None:
    """``--stream``: a block-causal transformer, and ``--frames`` / sizes its chunks and blocks fit; checked
    from the configs before anything is loaded or written."""
    from diffusers import AutoencoderKLWan


    config = saved_transformer_config(args)
    mhla = MHLAConfig.from_dict(config["mhla"]) if config.get("mhla") else None
    vae = AutoencoderKLWan.load_config(args.model, subfolder="vae")
    height, width = args.height or WAN_DEFAULT_SIZE[0], args.width or WAN_DEFAULT_SIZE[1]
    check_stream_settings(mhla, config, args.frames, height, width, vae.get("scale_factor_temporal", 4),
                          vae.get("scale_factor_spatial", 8))


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    mhla = None
    if args.blocks is not None:
        mhla = MHLAConfig(blocks=tuple(args.blocks))
    check_labels(args)
    if args.stream:
        check_stream(args)
    if args.image:
        pair_images(args.prompt, args.image, "--image")
        check_images(args.image, "--image")
    check_sampling(base_for(args.base).sampler.load(), args.model, args.transformer, settings(args), mhla,
                   {"model": "--model", "transformer": "--transformer", "mhla": "--blocks"})
    out = check_out(args)
    loaded = load(args, mhla, dtype)
    claim(out, OUTPUT_KIND, "--out")
    if base_for(args.base).video:
        for path in sample_videos(args, loaded, out):
            print(f"wrote {path}")
        return
    images = sample_images(args, loaded)
    *names, grid_name = output_names(args)
    for image, name in zip(images, names):
        image.save(out / name)
    image_grid(images).save(out / grid_name)
    print(f"wrote {len(images)} image{'s' if len(images) != 1 else ''} and {out / grid_name}")


if __name__ == "__main__":
    run(main)
