r"""Fine-tune a pretrained Sana diffusers checkpoint into MHLA (flow matching) with Accelerate.

mhla-gen finetune-sana --config sana_mhla model.pretrained=PATH_OR_HUB_ID data.path=DIR
accelerate launch --config_file "$(mhla-gen configs accelerate/ddp)" -m mhla_gen finetune-sana \
    --config ... key=value

Settings, data formats and launch configs: docs/training.md (the task: mhla_gen.train.finetune.SanaTask).
"""

from mhla_gen.bases.sana import BASE
from mhla_gen.commands.cli import run, train_main


def main(argv=None):
    return train_main(BASE.name, __doc__, None, argv)


if __name__ == "__main__":
    run(main)
