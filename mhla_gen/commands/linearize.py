r"""Stage 1 of converting a pretrained model to MHLA: attention transfer, then hybrid layers.

mhla-gen linearize --config dit_digits model.init_from=runs/softmax/final \
    output_dir=runs/linearize_digits train.ema_decay=0
mhla-gen linearize --config linearize/dit_xl2_256 data.path=/data/imagenet/train
mhla-gen linearize --base sana --config linearize/sana_600m_1024 data.path=DIR
mhla-gen linearize --base wan --config linearize/wan_1_3b_480p data.path=DIR

Every MHLA layer learns to reproduce the frozen teacher layer's output from the teacher's own input
(mhla_gen.train.transfer). Output: output_dir/final (the converted transformer: continue it with
train_dit.py or finetune_*.py model.init_from=...), transfer.json and
transfer_errors.png. Settings: the base script's, plus transfer.trainable (all, the default | mhla |
mhla+qk), transfer.output_weight (the end-to-end term; 0), transfer.eval_batches and
hybrid.softmax_layers (null | auto:K | [layers]).
"""

from mhla_gen.commands.cli import linearize_main, run


def main(argv=None):
    return linearize_main(argv, description=__doc__)


if __name__ == "__main__":
    run(main)
