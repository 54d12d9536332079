"""``python eval/generate.py ARGS`` is ``mhla-gen generate ARGS``: generate an evaluation sample set
(files + manifest).

The command lives in ``mhla_gen/commands/generate.py``; this file keeps the command lines written for a
checkout working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.cli import run
from mhla_gen.commands.generate import *  # noqa: F403
from mhla_gen.commands.generate import main

if __name__ == "__main__":
    run(main)
