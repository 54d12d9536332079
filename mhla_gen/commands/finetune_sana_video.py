r"""Fine-tune a pretrained SANA-Video diffusers checkpoint into MHLA (flow matching) with Accelerate.

mhla-gen finetune-sana-video --config sana-video_mhla data.path=DIR
accelerate launch --config_file "$(mhla-gen configs accelerate/ddp)" -m mhla_gen finetune-sana-video \
    --config ... key=value

Settings, data formats and launch configs: docs/training.md (the task:
mhla_gen.train.finetune_sana_video.SanaVideoTask).
"""

from mhla_gen.bases.sana_video import BASE
from mhla_gen.commands.cli import run, train_main


def main(argv=None):
    return train_main(BASE.name, __doc__, None, argv)


if __name__ == "__main__":
    run(main)
