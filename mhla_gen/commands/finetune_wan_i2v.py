r"""Fine-tune a pretrained Wan image-to-video diffusers checkpoint into MHLA (flow matching) with Accelerate.

mhla-gen finetune-wan-i2v --config wan_mhla_hybrid \
    model.pretrained=Wan-AI/Wan2.1-I2V-14B-480P-Diffusers data.path=DIR
accelerate launch --config_file "$(mhla-gen configs accelerate/fsdp)" -m mhla_gen finetune-wan-i2v \
    --config ... key=value

Each video's first frame is its condition. Settings, data formats and launch configs:
docs/training.md (the task: mhla_gen.train.finetune_wan_i2v.WanI2VTask).
"""

from mhla_gen.bases.wan_i2v import BASE
from mhla_gen.commands.cli import run, train_main


def main(argv=None):
    return train_main(BASE.name, __doc__, None, argv)


if __name__ == "__main__":
    run(main)
