"""Adopt a folder that an mhla_gen version without folder markers wrote.

    python -m mhla_gen.adopt run runs/old_run
    python -m mhla_gen.adopt latent_cache /data/imagenet256_latents

Every command refuses to write into a non-empty folder that does not carry mhla_gen's marker
(``.mhla_gen.json``, see :mod:`mhla_gen.folders`), whatever the names of its files. This command is the
explicit way to say "this folder is mhla_gen's": it writes the marker, after checking that the folder holds
only entries a folder of that kind holds.
"""

from __future__ import annotations

import argparse

from .cli import run
from .folders import KINDS, adopt


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mhla_gen.adopt",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kind", choices=sorted(KINDS), help="what the folder is")
    parser.add_argument("folder")
    args = parser.parse_args(argv)
    folder = adopt(args.folder, args.kind)
    print(f"{folder} is now marked as a {KINDS[args.kind][0]} folder of mhla_gen")


if __name__ == "__main__":
    run(main)
