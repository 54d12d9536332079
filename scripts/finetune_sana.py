"""Fine-tune a pretrained Sana diffusers checkpoint into MHLA (flow matching) with Accelerate.

python scripts/finetune_sana.py --config configs/sana_mhla.yaml model.pretrained=PATH_OR_HUB_ID data.path=DIR
accelerate launch --config_file configs/accelerate/ddp.yaml scripts/finetune_sana.py --config ... key=value
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for scripts._cli (mhla_gen is installed)

from mhla_gen.cli import run  # noqa: E402
from mhla_gen.train.config import SanaRunConfig  # noqa: E402
from mhla_gen.train.finetune import SanaTask  # noqa: E402
from mhla_gen.train.loop import train  # noqa: E402
from scripts._cli import parse_run_args  # noqa: E402


def main(argv=None):
    cfg = parse_run_args(SanaRunConfig, __doc__.splitlines()[0], None, argv)
    train(cfg, SanaTask(cfg))


if __name__ == "__main__":
    run(main)
