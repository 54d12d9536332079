"""Train a class-conditional DiT (softmax, linear or MHLA attention) with Accelerate.

python scripts/train_dit.py                                   # the digits main job (CPU, minutes)
python scripts/train_dit.py --config configs/dit_xl2_imagenet256.yaml data.path=/data/imagenet/train
accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_dit.py --config ... key=value
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for scripts._cli (mhla_gen is installed)

from mhla_gen.cli import run  # noqa: E402
from mhla_gen.train.config import DiTRunConfig  # noqa: E402
from mhla_gen.train.dit import DiTTask  # noqa: E402
from mhla_gen.train.loop import train  # noqa: E402
from scripts._cli import parse_run_args  # noqa: E402


def main(argv=None):
    cfg = parse_run_args(
        DiTRunConfig, __doc__.splitlines()[0], str(REPO / "configs" / "dit_digits.yaml"), argv
    )
    train(cfg, DiTTask(cfg))


if __name__ == "__main__":
    run(main)
