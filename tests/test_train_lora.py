"""train.trainable=lora in scripts/finetune_sana.py and scripts/finetune_wan.py (tiny checkpoints and data):
final/ = LoRA adapter + MHLA parameters, loadable with load_transformer and the pipelines; a run stopped by
train.max_steps and resumed (resume=latest) ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from train_helpers import REPO, read_metrics, run_inprocess, write_captioned_videos

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


@pytest.fixture(scope="module")
def sana_setup(tmp_path_factory):
    from PIL import Image

    from mhla_gen.testing import tiny_sana_pipeline

    root = tmp_path_factory.mktemp("sana_lora")
    tiny_sana_pipeline().save_pretrained(root / "ckpt")
    rng = np.random.default_rng(0)
    (root / "data").mkdir()
    for i, caption in enumerate(["a red cat", "a blue dog", "a small cat", "a green dog"]):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / "data" / f"{i}.png")
        (root / "data" / f"{i}.txt").write_text(caption)
    return root


@pytest.fixture(scope="module")
def wan_setup(tmp_path_factory):
    from mhla_gen.testing.wan import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("wan_lora")
    tiny_wan_pipeline().save_pretrained(root / "ckpt")
    write_captioned_videos(root / "data", height=32, width=32)
    return root


def finetune(script: str, setup, out, *overrides):
    run_inprocess(
        script,
        "--config",
        str(REPO / "mhla_gen" / "configs" / "tiny" / ("sana.yaml" if "sana" in script else "wan.yaml")),
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
@pytest.mark.parametrize("script", ["finetune_sana.py", "finetune_wan.py"])
def test_lora_finetune_final_folder_and_exact_resume(script, sana_setup, wan_setup, tmp_path):
    from mhla_gen import load_transformer, mhla_parameters

    setup = sana_setup if "sana" in script else wan_setup
    finetune(script, setup, tmp_path / "whole", "train.max_steps=3")
    finetune(script, setup, tmp_path / "split", "train.max_steps=2")  # checkpoint_2, then stops
    finetune(script, setup, tmp_path / "split", "train.max_steps=3")  # resume=latest: step 3 only
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
    base = {k.replace(".base_layer.", "."): v for k, v in state.items() if "lora_" not in k}
    assert all(torch.equal(base[k], pretrained[k]) for k in pretrained)

    if "sana" in script:
        from mhla_gen.pipelines.sana import load_sana_pipeline as load_pipeline
    else:
        from mhla_gen.pipelines.wan import load_wan_pipeline as load_pipeline
    pipe = load_pipeline(setup / "ckpt", transformer_path=final, torch_dtype=torch.float32)
    assert pipe.transformer.mhla_config == model.mhla_config and "default" in pipe.transformer.peft_config


def test_lora_checkpoint_refused_by_a_full_run(sana_setup, tmp_path):
    """A LoRA checkpoint has other parameters than a full run's: resuming across modes is refused."""
    finetune("finetune_sana.py", sana_setup, tmp_path, "train.max_steps=2", "train.checkpoint_every=1")
    with pytest.raises(ValueError, match="lora"):
        run_inprocess(
            "finetune_sana.py",
            "--config",
            str(REPO / "mhla_gen" / "configs" / "tiny" / "sana.yaml"),
            f"model.pretrained={sana_setup / 'ckpt'}",
            f"data.path={sana_setup / 'data'}",
            f"data.cache_dir={sana_setup / 'cache'}",
            f"output_dir={tmp_path}",
            "train.max_steps=3",
        )
