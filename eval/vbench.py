"""``python eval/vbench.py ARGS`` is ``mhla-gen vbench ARGS``: score videos: VBench-style dimensions.

The command lives in ``mhla_gen/commands/vbench.py``; this file keeps the command lines written for a
checkout working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.cli import run
from mhla_gen.commands.vbench import *  # noqa: F403
from mhla_gen.commands.vbench import main

if __name__ == "__main__":
    run(main)
