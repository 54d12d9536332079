"""``python eval/attention_stats.py ARGS`` is ``mhla-gen attention-stats ARGS``: per-layer attention rank
and entropy of a saved transformer.

The command lives in ``mhla_gen/commands/attention_stats.py``; this file keeps the command lines written for
a checkout working and re-exports the command's names for code that loads it.
"""

from mhla_gen.commands.attention_stats import *  # noqa: F403
from mhla_gen.commands.attention_stats import main
from mhla_gen.commands.cli import run

if __name__ == "__main__":
    run(main)
