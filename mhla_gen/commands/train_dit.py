"""Train a class-conditional DiT (softmax, linear or MHLA attention) with Accelerate.

python scripts/train_dit.py                                   # the digits main job (CPU, minutes)
python scripts/train_dit.py --config configs/dit_xl2_imagenet256.yaml data.path=/data/imagenet/train
accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_dit.py --config ... key=value
"""

from pathlib import Path

from mhla_gen.cli import run, train_main

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "dit_digits.yaml"


def main(argv=None):
    return train_main("dit", __doc__.splitlines()[0], str(DEFAULT_CONFIG), argv)


if __name__ == "__main__":
    run(main)
