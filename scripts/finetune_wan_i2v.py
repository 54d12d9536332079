"""``python scripts/finetune_wan_i2v.py ARGS`` is ``mhla-gen finetune-wan-i2v ARGS``: fine-tune a
pretrained Wan image-to-video model into MHLA.

The command lives in ``mhla_gen/commands/finetune_wan_i2v.py``; this file keeps the command lines written for
a checkout working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.cli import run
from mhla_gen.commands.finetune_wan_i2v import *  # noqa: F403
from mhla_gen.commands.finetune_wan_i2v import main

if __name__ == "__main__":
    run(main)
