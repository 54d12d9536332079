"""``python eval/fid.py ARGS`` is ``mhla-gen fid ARGS``: score images: FID, sFID, KID, IS, precision,
recall.

The command lives in ``mhla_gen/commands/fid.py``; this file keeps the command lines written for a checkout
working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.cli import run
from mhla_gen.commands.fid import *  # noqa: F403
from mhla_gen.commands.fid import main

if __name__ == "__main__":
    run(main)
