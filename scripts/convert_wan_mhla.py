"""``python scripts/convert_wan_mhla.py ARGS`` is ``mhla-gen convert-wan ARGS``: convert the released Wan-
MHLA checkpoint into a diffusers folder.

The command lives in ``mhla_gen/commands/convert_wan.py``; this file keeps the command lines written for a
checkout working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.cli import run
from mhla_gen.commands.convert_wan import *  # noqa: F403
from mhla_gen.commands.convert_wan import main

if __name__ == "__main__":
    run(main)
