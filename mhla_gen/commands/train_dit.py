r"""Train a class-conditional DiT (softmax, linear or MHLA attention) with Accelerate.

mhla-gen train-dit                                   # the digits main job (CPU, minutes)
mhla-gen train-dit --config dit_xl2_imagenet256 data.path=/data/imagenet/train
accelerate launch --config_file "$(mhla-gen configs accelerate/ddp)" -m mhla_gen train-dit \
    --config ... key=value
"""

from mhla_gen.bases.dit import BASE
from mhla_gen.commands.cli import run, train_main

DEFAULT_CONFIG = "dit_digits"  # the shipped mhla_gen/configs/dit_digits.yaml (mhla_gen.configs)


def main(argv=None):
    return train_main(BASE.name, __doc__, DEFAULT_CONFIG, argv)


if __name__ == "__main__":
    run(main)
