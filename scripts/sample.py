"""``python scripts/sample.py ARGS`` is ``mhla-gen sample ARGS``: sample images or videos through the
stock diffusers pipelines.

The command lives in ``mhla_gen/commands/sample.py``; this file keeps the command lines written for a
checkout working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.cli import run
from mhla_gen.commands.sample import *  # noqa: F403
from mhla_gen.commands.sample import main

if __name__ == "__main__":
    run(main)
