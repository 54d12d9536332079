"""``python scripts/finetune_wan.py ARGS`` is ``mhla-gen finetune-wan ARGS``: fine-tune a pretrained
Wan2.1 / 2.2 into MHLA.

The command lives in ``mhla_gen/commands/finetune_wan.py``; this file keeps the command lines written for a
checkout working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.cli import run
from mhla_gen.commands.finetune_wan import *  # noqa: F403
from mhla_gen.commands.finetune_wan import main

if __name__ == "__main__":
    run(main)
