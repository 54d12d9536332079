"""``python scripts/extract_latents.py ARGS`` is ``mhla-gen extract-latents ARGS``: encode an image class
folder into a DiT latent cache.

The command lives in ``mhla_gen/commands/extract_latents.py``; this file keeps the command lines written for
a checkout working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.cli import run
from mhla_gen.commands.extract_latents import *  # noqa: F403
from mhla_gen.commands.extract_latents import main

if __name__ == "__main__":
    run(main)
