"""The command line every training script shares: ``--config FILE`` plus ``key=value`` overrides.

Kept in scripts/ (not mhla_gen) so the library has no argparse.
"""

from __future__ import annotations

import argparse
import logging


def parse_run_args(
    schema, description: str, default_config: str | None = None, argv: list[str] | None = None
):
    """``schema`` instance from ``--config`` (default ``default_config``) and dotlist overrides."""
    from mhla_gen.train.config import load_config

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--config",
        default=default_config,
        help=f"YAML listing deviations from the defaults (default: {default_config})",
    )
    parser.add_argument(
        "overrides", nargs="*", help="OmegaConf dotlist, e.g. train.max_steps=10 output_dir=runs/x"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate.checkpointing").setLevel(logging.WARNING)  # one INFO line per saved file
    logging.getLogger("accelerate.accelerator").setLevel(logging.WARNING)  # "Saving current state to ..."
    # (mhla_gen.train.checkpoint logs one line once a checkpoint is in place)
    return load_config(schema, args.config, args.overrides)
