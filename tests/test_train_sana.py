"""scripts/finetune_sana.py on a tiny SANA checkpoint (save_pretrained) and a tiny captioned image folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from train_helpers import REPO, final_weights, read_metrics, run_inprocess

TINY = str(REPO / "configs" / "tiny" / "sana.yaml")


@pytest.fixture(scope="module")
def sana_setup(tmp_path_factory):
    from mhla_gen.testing import tiny_sana_pipeline

    root = tmp_path_factory.mktemp("sana")
    tiny_sana_pipeline().save_pretrained(root / "ckpt")
    rng = np.random.default_rng(0)
    (root / "data").mkdir()
    with open(root / "data" / "metadata.jsonl", "w") as f:
        for i, caption in enumerate(["a red cat", "a blue dog", "a small cat", "a green dog"]):
            Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(
                root / "data" / f"{i}.png"
            )
            f.write(json.dumps({"file_name": f"{i}.png", "text": caption}) + "\n")
    (root / "data" / "4.png").write_bytes(b"broken")  # captioned but unreadable: skipped when caching
    with open(root / "data" / "metadata.jsonl", "a") as f:
        f.write(json.dumps({"file_name": "4.png", "text": "a cat"}) + "\n")
    return root


def finetune(setup, out, *overrides):
    run_inprocess(
        "finetune_sana.py",
        "--config",
        TINY,
        f"model.pretrained={setup / 'ckpt'}",
        f"data.path={setup / 'data'}",
        f"output_dir={out}",
        *overrides,
    )


def test_finetune_all_weights_checkpoint_resume(sana_setup, tmp_path):
    from mhla_gen.serialization import load_transformer

    accumulate = "train.gradient_accumulation_steps=2"  # global batch 2 = 2 micro-batches of 1
    finetune(sana_setup, tmp_path, "train.max_steps=2", accumulate)
    meta = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert meta["count"] == 4 and meta["skipped"] == 1
    item = load_file(str(tmp_path / "cache" / "items" / "00000000.safetensors"))
    assert item["latents"].shape == (4, 16, 16) and item["prompt_embeds"].shape == (8, 16)
    assert (tmp_path / "samples" / "step_0000002.png").is_file()
    finetune(sana_setup, tmp_path, "train.max_steps=3", accumulate)  # resume=latest: continues at step 3
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "checkpoint_3").is_dir()
    model = load_transformer(tmp_path / "final")
    assert model.mhla_config.blocks == (2, 2)
    assert torch.isfinite(torch.tensor([r["loss"] for r in read_metrics(tmp_path)])).all()


def test_finetune_only_mhla_parameters(sana_setup, tmp_path):
    finetune(sana_setup, tmp_path, "train.max_steps=2", "train.trainable=mhla", "log.sample_every=0")
    before = load_file(str(sana_setup / "ckpt" / "transformer" / "diffusion_pytorch_model.safetensors"))
    after = final_weights(tmp_path)
    mhla_keys = [k for k in after if k not in before]
    assert mhla_keys and all(".processor.mixing" in k for k in mhla_keys)
    assert all(torch.equal(before[k], after[k]) for k in before)  # frozen: bit-identical
    from mhla_gen import MHLAConfig
    from mhla_gen.install import install_mhla
    from mhla_gen.testing import tiny_sana

    fresh = install_mhla(tiny_sana(), MHLAConfig(blocks=(2, 2))).state_dict()
    assert any(not torch.equal(fresh[k], after[k]) for k in mhla_keys)  # the mixing matrices trained


def test_missing_image_folder(sana_setup, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing_images"):
        run_inprocess(
            "finetune_sana.py",
            "--config",
            TINY,
            f"model.pretrained={sana_setup / 'ckpt'}",
            f"data.path={tmp_path / 'missing_images'}",
            f"output_dir={tmp_path / 'run'}",
        )
