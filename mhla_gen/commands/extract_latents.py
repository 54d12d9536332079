r"""Encode an ImageNet-style class folder into a DiT latent cache (image + flip, ADM center crop).

    mhla-gen extract-latents --data /data/imagenet/train --out /data/imagenet256_latents \
        --vae stabilityai/sd-vae-ft-ema --resolution 256
    mhla-gen train-dit --config dit_xl2_imagenet256 data.source=latents \
        data.path=/data/imagenet256_latents
"""

import argparse
import logging
from pathlib import Path

import torch

from mhla_gen.commands.cli import device_setting, expand_path, run
from mhla_gen.data import ClassFolderDataset, write_class_latents
from mhla_gen.data.latents import LATENT_CACHE, check_cache_target
from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import input_record


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data", required=True, type=expand_path, help="class folder root: DATA/<class>/<image>"
    )
    parser.add_argument(
        "--out",
        required=True,
        type=expand_path,
        help="cache folder to write: new, empty or an earlier latent cache of mhla_gen (replaced when "
        "complete)",
    )
    parser.add_argument(
        "--vae", default="stabilityai/sd-vae-ft-ema", type=expand_path, help="AutoencoderKL folder or hub id"
    )
    parser.add_argument("--vae-subfolder", default=None)
    parser.add_argument("--resolution", type=positive_int, default=256)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="seed of the latent-distribution samples")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device_setting(args.device)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from diffusers import AutoencoderKL

    # before any work: --out must not overlap --data nor hold files of its own
    check_cache_target(LATENT_CACHE, args.out, "--out", {"--data": args.data, "--vae": args.vae})
    dataset = ClassFolderDataset(args.data, args.resolution, "--data")
    try:
        config = AutoencoderKL.load_config(args.vae, subfolder=args.vae_subfolder)
        factor = 2 ** (len(config["block_out_channels"]) - 1)  # the VAE's downsampling
        if args.resolution % factor:
            raise ConfigError(f"--resolution {args.resolution} is not a multiple of the VAE's downsampling "
                              f"factor {factor}: the latents would not cover the image exactly")
        vae = AutoencoderKL.from_pretrained(args.vae, subfolder=args.vae_subfolder)
    except OSError as err:
        raise ConfigError(f"--vae {args.vae!r} cannot be loaded: {err}") from None
    vae = vae.to(args.device).eval()
    generator = torch.Generator(args.device).manual_seed(args.seed)

    def encode(pixels: torch.Tensor) -> torch.Tensor:  # (B, 3, R, R) in [-1, 1] -> scaled latents
        dist = vae.encode(pixels.to(args.device)).latent_dist
        return dist.sample(generator) * vae.config.scaling_factor  # as DiT's feature extraction

    meta = {
        "vae": str(Path(args.vae).resolve()) if Path(args.vae).exists() else args.vae,  # checked by train_dit
        "vae_subfolder": args.vae_subfolder,
        "vae_record": input_record(args.vae),  # resolved, with a fingerprint of its weights
        "data": str(Path(args.data).resolve()),
        "resolution": args.resolution,
        "scaling_factor": vae.config.scaling_factor,
        "classes": dataset.classes,
        "num_classes": len(dataset.classes),
    }
    out = write_class_latents(dataset, encode, args.out, meta, args.batch_size, settings=("--out", "--data"))
    print(f"wrote {out}")


if __name__ == "__main__":
    run(main)
