"""Fine-tune a pretrained Wan image-to-video diffusers checkpoint into MHLA (flow matching) with Accelerate.

python scripts/finetune_wan_i2v.py --config configs/wan_mhla_hybrid.yaml \
    model.pretrained=Wan-AI/Wan2.1-I2V-14B-480P-Diffusers data.path=DIR
accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/finetune_wan_i2v.py --config ... k=v

Same program as finetune_wan.py (mhla_gen.cli.train_main; the task is
mhla_gen.train.finetune_wan_i2v.WanI2VTask): each video's first frame is its condition.
"""

from mhla_gen.cli import run, train_main


def main(argv=None):
    return train_main("wan-i2v", __doc__.splitlines()[0], None, argv)


if __name__ == "__main__":
    run(main)
