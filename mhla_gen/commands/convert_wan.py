r"""Convert the released Wan-MHLA checkpoint (original Wan key names) into a diffusers transformer folder.

    mhla-gen convert-wan --checkpoint ckpts/wan_mhla.safetensors \
        --config-from Wan-AI/Wan2.1-T2V-1.3B-Diffusers --out converted/wan-mhla --dtype bf16

``--config-from`` is a diffusers Wan pipeline (local folder or hub id), its ``transformer`` folder, or
a ``config.json``. The output loads with ``mhla_gen.load_transformer(OUT)`` and plugs into
``mhla_gen.pipelines.wan.load_wan_pipeline(BASE, transformer_path=OUT)``. See
``mhla_gen/integration/convert_wan.py`` for how the release differs from this library's defaults.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mhla_gen.commands.cli import expand_path, run
from mhla_gen.integration.cards import (
    check_push_target,
    check_repo_id,
    model_card,
    push_to_hub,
    scrub_local_paths,
    write_card,
)
from mhla_gen.integration.convert_wan import convert_wan_checkpoint, converted_card_facts
from mhla_gen.outputs.folders import (
    check_apart,
    check_replaceable,
    check_temp,
    fresh_temp,
    input_record,
    replace_with,
    write_marker,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, type=expand_path,
                        help=".safetensors / .pth file or a folder of shards")
    parser.add_argument("--config-from", required=True, type=expand_path,
                        help="diffusers Wan folder, hub id or config.json")
    parser.add_argument("--out", required=True, type=expand_path,
                        help="output folder (save_pretrained layout): new, empty, or one this script wrote "
                             "(replaced when the new one is complete)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--state-dict-key", default=None, help="entry of a wrapped .pth, e.g. state_dict_ema")
    parser.add_argument("--base-model", default=None,
                        help="hub id of --config-from's pipeline, named in the model card")
    parser.add_argument("--license", default=None, help="the model card's license")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO_ID",
                        help="upload --out to this Hub model repo once written (huggingface_hub)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    # before any work: --out must be apart from the inputs and new, empty or a model folder of ours
    check_apart(args.out, "--out", {"--checkpoint": args.checkpoint, "--config-from": args.config_from})
    check_replaceable(args.out, "model", "--out")
    check_temp(args.out, "model", "--out")
    check_push_target(args.push_to_hub, "--push-to-hub")
    check_repo_id(args.base_model, "--base-model")
    transformer = convert_wan_checkpoint(
        args.checkpoint, args.config_from, torch_dtype=DTYPES[args.dtype], state_dict_key=args.state_dict_key
    )
    tmp = fresh_temp(args.out, "model", "--out")  # save_pretrained only ever sees a folder of its own
    transformer.save_pretrained(tmp)
    scrub_local_paths(tmp)  # shared as it is: no local path in its files; a model card
    facts = converted_card_facts(transformer, Path(args.out), args.checkpoint, args.config_from,
                                 args.base_model, args.license, args.push_to_hub)
    write_card(tmp, model_card(facts))
    write_marker(tmp, "model", converted_from=input_record(args.checkpoint))  # recorded, resolved
    replace_with(tmp, args.out, "model", "--out")
    if args.push_to_hub:
        push_to_hub(args.out, args.push_to_hub)
    cfg = transformer.mhla_config
    layers = "all" if cfg.layers is None else cfg.layers
    print(f"wrote {args.out}: {len(transformer.blocks)} blocks, MHLA layers {layers}, blocks {cfg.blocks}")
    print(f"MHLA config: {cfg.to_dict()}")


if __name__ == "__main__":
    run(main)
