"""``python scripts/train_dit.py ARGS`` is ``mhla-gen train-dit ARGS``: train a class-conditional DiT
(default: the digits main job).

The command lives in ``mhla_gen/commands/train_dit.py``; this file keeps the command lines written for a
checkout working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.cli import run
from mhla_gen.commands.train_dit import *  # noqa: F403
from mhla_gen.commands.train_dit import main

if __name__ == "__main__":
    run(main)
