r"""Fine-tune a pretrained Wan diffusers checkpoint into MHLA (flow matching) with Accelerate.

mhla-gen finetune-wan --config wan_mhla_hybrid model.pretrained=PATH data.path=DIR
accelerate launch --config_file "$(mhla-gen configs accelerate/ddp)" -m mhla_gen finetune-wan \
    --config ... key=value

Settings, data formats and launch configs: docs/training.md (the task: mhla_gen.train.finetune.WanTask).
"""

from mhla_gen.bases.wan import BASE
from mhla_gen.commands.cli import run, train_main


def main(argv=None):
    return train_main(BASE.name, __doc__, None, argv)


if __name__ == "__main__":
    run(main)
