"""``python scripts/linearize.py ARGS`` is ``mhla-gen linearize ARGS``: stage 1 of converting a pretrained
model: attention transfer, hybrid layers.

The command lives in ``mhla_gen/commands/linearize.py``; this file keeps the command lines written for a
checkout working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.cli import run
from mhla_gen.commands.linearize import *  # noqa: F403
from mhla_gen.commands.linearize import main

if __name__ == "__main__":
    run(main)
