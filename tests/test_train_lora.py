"""train.trainable=lora in the fine-tuning scripts (tiny checkpoints and data):
final/ = LoRA adapter + MHLA parameters, loadable with load_transformer and the pipelines; a run stopped by
train.max_steps and resumed (resume=latest) ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from train_helpers import (
    one_per_kind,
    read_metrics,
    run_inprocess,
    tiny_config,
    training_script,
    write_captioned_videos,
)

from mhla_gen.bases import BASES
from mhla_gen.integration.cards import CARD
from mhla_gen.integration.lora import ADAPTER_WEIGHTS, MANIFEST, MHLA_WEIGHTS
from mhla_gen.outputs.folders import LISTING, MARKER, read_marker

# EMA on: it averages the trained parameters (LoRA + MHLA) and final/ holds the averages
LORA = (
    "train.trainable=lora",
    "train.lora_rank=2",
    "train.lora_alpha=4",
    "train.ema_decay=0.5",
    "log.sample_every=0",
)
# three LoRA runs each (tens of seconds a base): one base of each kind of sample (image, video) among those
# with diffusers' LoRA loader fine-tuned from captions
LORA_BASES = one_per_kind(b for b in BASES.values() if "lora" in b.capabilities and b.trains
                          and b.conditioning == "captions")
SANA = BASES["sana"].name  # resuming across modes


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """``setups(base)``: a folder with the base's tiny checkpoint (``ckpt``) and 4 captioned images or 2
    captioned videos (``data``), made once per base."""
    made = {}

    def setup(base: str):
        if base not in made:
            root = made[base] = tmp_path_factory.mktemp(f"{base}_lora")
            BASES[base].tiny.load().pipeline().save_pretrained(root / "ckpt")
            if BASES[base].video:
                write_captioned_videos(root / "data", height=32, width=32)
            else:
                _write_captioned_images(root / "data")
        return made[base]

    return setup


def _write_captioned_images(folder) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir()
    for i, caption in enumerate(["a red cat", "a blue dog", "a small cat", "a green dog"]):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(caption)


def finetune(base: str, setup, out, *overrides):
    run_inprocess(
        training_script(base),
        "--config",
        tiny_config(base),
        f"model.pretrained={setup / 'ckpt'}",
        f"data.path={setup / 'data'}",
        f"data.cache_dir={setup / 'cache'}",  # encoded once, shared by the runs
        f"output_dir={out}",
        *LORA,
        *overrides,
    )


def final_tensors(out) -> dict[str, torch.Tensor]:
    return {
        f"{name}:{key}": tensor
        for name in (ADAPTER_WEIGHTS, MHLA_WEIGHTS)
        for key, tensor in load_file(out / "final" / name).items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("base", LORA_BASES)
def test_lora_finetune_final_folder_and_exact_resume(base, setups, tmp_path):
    from mhla_gen import load_transformer, mhla_parameters

    setup = setups(base)
    finetune(base, setup, tmp_path / "whole", "train.max_steps=3")
    finetune(base, setup, tmp_path / "split", "train.max_steps=2")  # checkpoint_2, then stops
    finetune(base, setup, tmp_path / "split", "train.max_steps=3")  # resume=latest: step 3 only
    assert [r["step"] for r in read_metrics(tmp_path / "split")] == [1, 2, 3]

    final = tmp_path / "split" / "final"
    expected = [ADAPTER_WEIGHTS, MHLA_WEIGHTS, MANIFEST, CARD, MARKER, LISTING]  # card rewritten at the end
    assert sorted(p.name for p in final.iterdir()) == sorted(expected)
    manifest = json.loads((final / MANIFEST).read_text())  # no absolute path; the marker keeps the local one
    assert manifest["base"] == "ckpt" and manifest["base_path"] == os.path.relpath(setup / "ckpt", final)
    assert read_marker(final)["base_record"]["path"] == str((setup / "ckpt").resolve())
    whole, split = final_tensors(tmp_path / "whole"), final_tensors(tmp_path / "split")
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[k], split[k]) for k in whole)  # LoRA + MHLA bit-identical

    # the adapter covers q/k/v/out of self- and cross-attention; LoRA B (zero at init) and MHLA trained
    adapter = load_file(final / ADAPTER_WEIGHTS)
    for proj in ("to_q", "to_k", "to_v", "to_out.0"):
        assert any(f"attn1.{proj}.lora_A" in k for k in adapter) and any(
            f"attn2.{proj}.lora_B" in k for k in adapter
        )
    assert all(adapter[k].abs().sum() > 0 for k in adapter if "lora_B" in k)
    model = load_transformer(final)
    assert (model.peft_config["default"].r, model.peft_config["default"].lora_alpha) == (2, 4.0)
    fresh = type(model).from_pretrained(setup / "ckpt", subfolder="transformer")
    from mhla_gen import install_mhla

    fresh_mhla = mhla_parameters(install_mhla(fresh, model.mhla_config))
    assert any(not torch.equal(p, fresh_mhla[k]) for k, p in mhla_parameters(model).items())

    # the base stayed frozen: in the last checkpoint, every pretrained weight is the checkpoint's own
    pretrained = load_file(setup / "ckpt" / "transformer" / "diffusion_pytorch_model.safetensors")
    state = load_file(tmp_path / "split" / "checkpoints" / "checkpoint_3" / "model.safetensors")
    frozen = {k.replace(".base_layer.", "."): v for k, v in state.items() if "lora_" not in k}
    assert all(torch.equal(frozen[k], pretrained[k]) for k in pretrained)

    pipe = BASES[base].sampler.load().load(setup / "ckpt", None, torch.float32, "cpu", final)
    assert pipe.transformer.mhla_config == model.mhla_config and "default" in pipe.transformer.peft_config


def test_lora_checkpoint_refused_by_a_full_run(setups, tmp_path):
    """A LoRA checkpoint has other parameters than a full run's: resuming across modes is refused."""
    sana_setup = setups(SANA)
    finetune(SANA, sana_setup, tmp_path, "train.max_steps=2", "train.checkpoint_every=1")
    with pytest.raises(ValueError, match="lora"):
        run_inprocess(
            training_script(SANA),
            "--config",
            tiny_config(SANA),
            f"model.pretrained={sana_setup / 'ckpt'}",
            f"data.path={sana_setup / 'data'}",
            f"data.cache_dir={sana_setup / 'cache'}",
            f"output_dir={tmp_path}",
            "train.max_steps=3",
        )
