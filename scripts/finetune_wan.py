"""Fine-tune a pretrained Wan diffusers checkpoint into MHLA (flow matching) with Accelerate.

python scripts/finetune_wan.py --config configs/wan_mhla_hybrid.yaml model.pretrained=PATH data.path=DIR
accelerate launch --config_file configs/accelerate/ddp.yaml scripts/finetune_wan.py --config ... key=value
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for scripts._cli (mhla_gen is installed)

from mhla_gen.cli import run  # noqa: E402
from mhla_gen.train.config import WanRunConfig  # noqa: E402
from mhla_gen.train.finetune import WanTask  # noqa: E402
from mhla_gen.train.loop import train  # noqa: E402
from scripts._cli import parse_run_args  # noqa: E402


def main(argv=None):
    cfg = parse_run_args(WanRunConfig, __doc__.splitlines()[0], None, argv)
    train(cfg, WanTask(cfg))


if __name__ == "__main__":
    run(main)
