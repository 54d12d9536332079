"""scripts/finetune_sana.py on a tiny SANA checkpoint (save_pretrained) and a tiny captioned image folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from train_helpers import REPO, final_weights, max_abs_diff, read_metrics, run_inprocess

TINY = str(REPO / "mhla_gen" / "configs" / "tiny" / "sana.yaml")


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
    """Accumulation 2 (global batch 2 = 2 micro-batches of 1): 2 steps, then resume=latest to 3, ends with
    exactly the weights of an uninterrupted 3-step run."""
    from mhla_gen.integration.loading import load_transformer

    run = tmp_path / "run"
    accumulate = "train.gradient_accumulation_steps=2"
    finetune(sana_setup, run, "train.max_steps=2", accumulate)
    meta = json.loads((run / "cache" / "meta.json").read_text())
    assert meta["count"] == 4 and meta["skipped"] == 1
    item = load_file(str(run / "cache" / "items" / "00000000.safetensors"))
    assert item["latents"].shape == (4, 16, 16) and item["prompt_embeds"].shape == (8, 16)
    assert (run / "samples" / "step_0000002.png").is_file()
    finetune(sana_setup, run, "train.max_steps=3", accumulate)  # resume=latest: continues at step 3
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert (run / "checkpoints" / "checkpoint_3").is_dir()
    model = load_transformer(run / "final")
    assert model.mhla_config.blocks == (2, 2)
    assert torch.isfinite(torch.tensor([r["loss"] for r in read_metrics(run)])).all()
    finetune(sana_setup, tmp_path / "ref", "train.max_steps=3", accumulate, "log.sample_every=0")
    assert max_abs_diff(final_weights(run), final_weights(tmp_path / "ref")) == 0.0


def test_finetune_only_mhla_parameters(sana_setup, tmp_path):
    finetune(sana_setup, tmp_path, "train.max_steps=2", "train.trainable=mhla", "log.sample_every=0")
    before = load_file(str(sana_setup / "ckpt" / "transformer" / "diffusion_pytorch_model.safetensors"))
    after = final_weights(tmp_path)
    mhla_keys = [k for k in after if k not in before]
    assert mhla_keys and all(".processor.mixing" in k for k in mhla_keys)
    assert all(torch.equal(before[k], after[k]) for k in before)  # frozen: bit-identical
    from mhla_gen import MHLAConfig
    from mhla_gen.integration.install import install_mhla
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


# ------------------------------------------------------------------------- start-up checks, cache safety
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.height=40"], r"data\.height=40 must be a multiple of 32"),  # SanaPipeline, at the end
        (["data.width=33"], r"data\.width=33 must be a multiple of 32"),
        (["mhla.blocks=[32,2]"], r"mhla\.blocks=\[32, 2\] does not fit the token grid \(16, 16\)"),
        (["data.max_sequence_length=0"], r"data\.max_sequence_length must be >= 1"),
        (["data.height=-32"], r"data\.height must be >= 1"),
        (["log.sample_steps=0"], r"log\.sample_steps must be >= 1"),
    ],
)
def test_bad_settings_fail_before_any_work(sana_setup, tmp_path, overrides, message):
    from mhla_gen.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        finetune(sana_setup, tmp_path / "run", *overrides)
    assert not (tmp_path / "run").exists()  # nothing written, nothing encoded


def test_wrong_model_family_is_named(sana_setup, tmp_path):
    from mhla_gen.errors import ConfigError
    from mhla_gen.testing.wan import tiny_wan_pipeline

    tiny_wan_pipeline().save_pretrained(tmp_path / "wan")
    with pytest.raises(
        ConfigError, match=r"model\.pretrained=.*wan'.* is a WanPipeline checkpoint, not a SanaPipeline"
    ):
        run_inprocess(
            "finetune_sana.py",
            "--config",
            TINY,
            f"model.pretrained={tmp_path / 'wan'}",
            f"data.path={sana_setup / 'data'}",
            f"output_dir={tmp_path / 'run'}",
        )


def test_a_cut_weight_file_in_the_pipeline_is_named_before_any_write(sana_setup, tmp_path):
    """A local model.pretrained whose VAE weights were cut short is refused in one line naming the setting
    and the file (headers read, no weights), before output_dir exists."""
    import shutil

    from mhla_gen.errors import ConfigError

    ckpt = shutil.copytree(sana_setup / "ckpt", tmp_path / "ckpt")
    weights = next((ckpt / "vae").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-16])
    with pytest.raises(ConfigError, match=r"model\.pretrained=.*ckpt.*vae/.*not a readable safetensors"):
        run_inprocess("finetune_sana.py", "--config", TINY, f"model.pretrained={ckpt}",
                      f"data.path={sana_setup / 'data'}", f"output_dir={tmp_path / 'run'}")
    assert not (tmp_path / "run").exists()


def _tree(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_cache_dir_never_deletes_what_is_not_a_cache(sana_setup, tmp_path):
    """data.cache_dir equal to the data, holding an unrelated file, equal to the run folder or inside the
    pretrained checkpoint: refused before any work, nothing deleted or written. A cache of ours (e.g. from
    another checkpoint) is rebuilt."""
    from mhla_gen.errors import ConfigError

    data = sana_setup / "data"
    before = _tree(data)
    with pytest.raises(ConfigError, match=r"data\.cache_dir=.* is data\.path="):
        finetune(sana_setup, tmp_path / "run", f"data.cache_dir={data}")
    with pytest.raises(ConfigError, match=r"data\.cache_dir=.* contains data\.path="):
        finetune(sana_setup, tmp_path / "run", f"data.cache_dir={sana_setup}")
    assert _tree(data) == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("mine")
    with pytest.raises(ConfigError, match=r"data\.cache_dir=.* not empty .*thesis\.tex"):
        finetune(sana_setup, tmp_path / "run", f"data.cache_dir={tmp_path / 'mine'}")
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "mine"
    with pytest.raises(ConfigError, match=r"data\.cache_dir=.* is output_dir="):  # both new: refused at
        finetune(sana_setup, tmp_path / "run", f"data.cache_dir={tmp_path / 'run'}")  # start-up, not later
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"data\.cache_dir=.*new' contains output_dir="):
        finetune(sana_setup, tmp_path / "new" / "run", f"data.cache_dir={tmp_path / 'new'}")
    assert not (tmp_path / "new").exists()
    checkpoint = _tree(sana_setup / "ckpt")  # the pretrained pipeline folder is an input too
    with pytest.raises(ConfigError, match=r"data\.cache_dir=.*ckpt/cache' is inside model\.pretrained="):
        finetune(sana_setup, tmp_path / "run", f"data.cache_dir={sana_setup / 'ckpt' / 'cache'}")
    assert _tree(sana_setup / "ckpt") == checkpoint and not (tmp_path / "run").exists()

    shared = f"data.cache_dir={tmp_path / 'cache'}"
    finetune(sana_setup, tmp_path / "a", shared, "train.max_steps=1", "log.sample_every=0")
    meta = json.loads((tmp_path / "cache" / "meta.json").read_text())
    finetune(sana_setup, tmp_path / "b", shared, "train.max_steps=1", "data.max_sequence_length=6")
    rebuilt = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert meta["fingerprint"]["max_sequence_length"] == 8
    assert rebuilt["fingerprint"]["max_sequence_length"] == 6
