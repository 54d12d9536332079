"""``python scripts/finetune_sana.py ARGS`` is ``mhla-gen finetune-sana ARGS``: fine-tune a pretrained
SANA into MHLA.

The command lives in ``mhla_gen/commands/finetune_sana.py``; this file keeps the command lines written for a
checkout working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.cli import run
from mhla_gen.commands.finetune_sana import *  # noqa: F403
from mhla_gen.commands.finetune_sana import main

if __name__ == "__main__":
    run(main)
