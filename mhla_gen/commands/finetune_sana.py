"""Fine-tune a pretrained Sana diffusers checkpoint into MHLA (flow matching) with Accelerate.

python scripts/finetune_sana.py --config configs/sana_mhla.yaml model.pretrained=PATH_OR_HUB_ID data.path=DIR
accelerate launch --config_file configs/accelerate/ddp.yaml scripts/finetune_sana.py --config ... key=value

Same program as finetune_wan.py (mhla_gen.cli.train_main; the task is mhla_gen.train.finetune.SanaTask).
"""

from mhla_gen.cli import run, train_main


def main(argv=None):
    return train_main("sana", __doc__.splitlines()[0], None, argv)


if __name__ == "__main__":
    run(main)
