"""Fine-tune a pretrained SANA-Video diffusers checkpoint into MHLA (flow matching) with Accelerate.

python scripts/finetune_sana_video.py --config configs/sana-video_mhla.yaml data.path=DIR
accelerate launch --config_file configs/accelerate/ddp.yaml scripts/finetune_sana_video.py --config ... k=v

Same program as finetune_wan.py (mhla_gen.cli.train_main; the task is
mhla_gen.train.finetune_sana_video.SanaVideoTask).
"""

from mhla_gen.cli import run, train_main


def main(argv=None):
    return train_main("sana-video", __doc__.splitlines()[0], None, argv)


if __name__ == "__main__":
    run(main)
