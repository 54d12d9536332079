"""One error path for every entry point: a user's mistake prints one line naming the setting, exits with
status 2, and nothing is written (``mhla_gen.commands.cli.run``, which every script and eval job calls)."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from test_ownership import TINY_DIT, load_script
from train_helpers import REPO, _reset_accelerate

from mhla_gen.commands.cli import run

TINY_SANA = str(REPO / "mhla_gen" / "configs" / "tiny" / "sana.yaml")


def fails_in_one_line(script: str, argv: list[str], capsys, monkeypatch) -> str:
    """Run ``script``'s main through ``mhla_gen.commands.cli.run`` as its ``__main__`` does; return the
    message."""
    module = load_script(script)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    capsys.readouterr()  # earlier output
    _reset_accelerate()
    try:
        with pytest.raises(SystemExit) as exit_info:
            run(lambda: module.main(argv))
    finally:
        _reset_accelerate()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]  # progress bars may come before it
    assert len(errors) == 1 and err.strip().endswith(errors[0]) and "Traceback" not in err, err
    return errors[0]


@pytest.fixture(scope="module")
def sana_ckpt(tmp_path_factory):
    from mhla_gen.testing import tiny_sana_pipeline

    root = tmp_path_factory.mktemp("sana_ckpt")
    tiny_sana_pipeline().save_pretrained(root)
    return root


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.heads=3"], r"model.hidden_size=32 is not divisible by model.heads=3"),
        (["seed=-1"], r"seed must be in 0..2\*\*32-1, got -1"),
        (["mhla.layers=[0,7]"], r"mhla.layers=\[0, 7\]: layers \[7\] out of range 0..1"),
        (["train.global_batch_size=4096"], r"dataset has 1797 items, fewer than one global batch \(4096\)"),
        (["model.num_classes=5"], r"model.num_classes=5 but data.source=digits has 10 classes"),
    ],
)
def test_train_dit_setting_errors(overrides, message, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    line = fails_in_one_line("scripts/train_dit.py", ["--config", TINY_DIT, f"output_dir={out}", *overrides],
                             capsys, monkeypatch)
    assert line.startswith("train_dit.py: error: ") and re.search(message, line)
    assert not out.exists()  # nothing written, config.yaml included


def test_resume_with_another_model_is_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    args = ["--config", TINY_DIT, f"output_dir={out}", "train.max_steps=2", "train.checkpoint_every=1"]
    _reset_accelerate()
    load_script("scripts/train_dit.py").main(args)
    line = fails_in_one_line("scripts/train_dit.py", [*args, "train.max_steps=3", "mhla.blocks=[1,1]"],
                             capsys, monkeypatch)
    assert "does not match the config:" in line and "mhla:" in line


def test_latents_with_another_vae_or_no_vae_model(tmp_path, capsys, monkeypatch):
    """The cache records its VAE; a mismatching data.vae (or one that does not load) stops at start-up."""
    from mhla_gen.testing import tiny_autoencoder_kl

    cache = tmp_path / "cache"
    cache.mkdir()
    np.save(cache / "latents.npy", np.zeros((10, 2, 4, 4, 4), np.float16))
    np.save(cache / "labels.npy", np.arange(10))
    tiny_autoencoder_kl().save_pretrained(tmp_path / "vae")
    (cache / "meta.json").write_text(json.dumps({"vae": str(tmp_path / "vae"), "scaling_factor": 0.5,
                                                 "num_classes": 10}))
    common = ["--config", TINY_DIT, f"output_dir={tmp_path / 'run'}", "data.source=latents",
              f"data.path={cache}"]
    line = fails_in_one_line("scripts/train_dit.py", [*common, f"data.vae={tmp_path / 'missing'}"],
                             capsys, monkeypatch)
    assert "data.vae=" in line and "cannot be loaded" in line
    tiny_autoencoder_kl().save_pretrained(tmp_path / "other_vae")
    line = fails_in_one_line("scripts/train_dit.py", [*common, f"data.vae={tmp_path / 'other_vae'}"],
                             capsys, monkeypatch)
    assert f"was encoded with vae='{tmp_path / 'vae'}'" in line and "set data.vae=" in line
    line = fails_in_one_line("scripts/train_dit.py", [*common, f"data.vae={tmp_path / 'vae'}"],
                             capsys, monkeypatch)
    assert "was scaled by 0.5" in line  # the tiny VAE's scaling factor is another
    assert not (tmp_path / "run").exists()


def test_class_folders_skip_hidden_and_empty_folders(tmp_path, caplog):
    from mhla_gen.data import ClassFolderDataset

    for name in ("cat", ".ipynb_checkpoints", "dog", "empty"):
        (tmp_path / name).mkdir()
    for name in ("cat", ".ipynb_checkpoints", "dog"):
        Image.new("RGB", (8, 8)).save(tmp_path / name / "a.png")
    data = ClassFolderDataset(tmp_path, 8)
    assert data.classes == ["cat", "dog"] and data.labels == [0, 1]
    assert "hidden: .ipynb_checkpoints; without images: empty" in caplog.text


def test_sana_bad_captions_and_batch_fail_before_the_cache(sana_ckpt, tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (40, 48)).save(data / "0.png")
    (data / "metadata.jsonl").write_text('{"file_name": "0.png"\n')
    common = ["--config", TINY_SANA, f"model.pretrained={sana_ckpt}", f"data.path={data}",
              f"output_dir={tmp_path / 'run'}"]
    line = fails_in_one_line("scripts/finetune_sana.py", common, capsys, monkeypatch)
    assert "metadata.jsonl:1: expected JSON" in line
    (data / "metadata.jsonl").write_text('{"file_name": "0.png", "text": "a cat"}\n')
    line = fails_in_one_line("scripts/finetune_sana.py", common, capsys, monkeypatch)
    assert "dataset has 1 items, fewer than one global batch (2)" in line
    assert not (tmp_path / "run").exists()


def test_sample_and_generate_refuse_labels_the_model_was_not_trained_on(tmp_path, capsys, monkeypatch):
    from mhla_gen import MHLAConfig, install_mhla
    from mhla_gen.outputs.folders import write_marker
    from mhla_gen.testing import tiny_dit_pipeline

    pipe = tiny_dit_pipeline()
    install_mhla(pipe.transformer, MHLAConfig(blocks=(2, 2)))
    pipe.save_pretrained(tmp_path / "pipe")
    write_marker(tmp_path / "pipe" / "transformer", "model", num_classes=3)  # as a training run records it
    line = fails_in_one_line("scripts/sample.py", ["--base", "dit", "--model", str(tmp_path / "pipe"),
                             "--labels", "5", "7", "--out", str(tmp_path / "out")], capsys, monkeypatch)
    assert "--labels [5, 7]: the model was trained on classes 0..2" in line
    line = fails_in_one_line("eval/generate.py", ["base=dit", f"model={tmp_path / 'pipe'}", "labels=[5]",
                             f"output_dir={tmp_path / 'gen'}"], capsys, monkeypatch)
    assert "labels [5] are outside the model's classes 0..2" in line
    line = fails_in_one_line("scripts/sample.py", ["--base", "dit", "--model", str(tmp_path / "pipe"),
                             "--labels", "1", "--guidance", "-3"], capsys, monkeypatch)
    assert "--guidance must be >= 0" in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "gen").exists()


@pytest.mark.parametrize("fps", ["0", "-8"])
def test_sample_refuses_a_frame_rate_below_one(fps, tmp_path, capsys, monkeypatch):
    """``--fps 0`` was passed to the video writer, which wrote the MP4 at its own default rate."""
    from mhla_gen.testing.wan import tiny_wan_pipeline

    tiny_wan_pipeline().save_pretrained(tmp_path / "wan")
    argv = ["--base", "wan", "--model", str(tmp_path / "wan"), "--prompt", "a cat", "--frames", "5",
            "--height", "16", "--width", "16", "--steps", "1", "--fps", fps, "--out", str(tmp_path / "out")]
    line = fails_in_one_line("scripts/sample.py", argv, capsys, monkeypatch)
    assert f"--fps must be positive, got {fps}" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value, message", [
    ("--seed", "-1", "--seed must be in 0..2**32-1, got -1"),
    ("--blocks", "0 2", "--blocks 0 2: "),
])
def test_sample_refuses_a_negative_seed_and_bad_blocks_naming_the_flag(flag, value, message, tmp_path, capsys,
                                                                       monkeypatch):
    """``--seed -1`` sampled into files named ``seed-1``; ``--blocks 0 2`` failed naming ``blocks``."""
    from mhla_gen.testing import tiny_dit_pipeline

    tiny_dit_pipeline().save_pretrained(tmp_path / "pipe")
    argv = ["--base", "dit", "--model", str(tmp_path / "pipe"), "--labels", "1", flag, *value.split(),
            "--out", str(tmp_path / "out")]
    line = fails_in_one_line("scripts/sample.py", argv, capsys, monkeypatch)
    assert message in line
    assert not (tmp_path / "out").exists()


def test_sample_wan_default_size_is_checked_against_the_model(tmp_path, capsys, monkeypatch):
    from mhla_gen.testing.wan import tiny_wan_pipeline

    tiny_wan_pipeline().save_pretrained(tmp_path / "wan")
    line = fails_in_one_line("scripts/sample.py", ["--base", "wan", "--model", str(tmp_path / "wan"),
                             "--prompt", "a cat", "--frames", "5", "--out", str(tmp_path / "out")],
                             capsys, monkeypatch)
    assert "480x832 gives a token grid of 30x52, beyond this model's rope_max_seq_len=32" in line


def test_eval_scripts_data_errors(tmp_path, capsys, monkeypatch):
    np.savez(tmp_path / "bad.npz", images=np.zeros(3))
    line = fails_in_one_line("eval/fid.py", ["--samples", str(tmp_path / "bad.npz"), "--ref", "digits"],
                             capsys, monkeypatch)
    assert "has no 'arr_0' image array" in line
    line = fails_in_one_line("eval/attention_stats.py", ["--model", str(tmp_path / "missing")], capsys,
                             monkeypatch)
    assert "missing" in line
    (tmp_path / "file").write_text("x")
    line = fails_in_one_line("eval/fid.py", ["--samples", str(tmp_path / "bad.npz"), "--ref", "digits",
                             "--out", str(tmp_path / "file" / "m.json")], capsys, monkeypatch)
    assert "--out=" in line and "is a file, not a folder" in line


DEVICE_SCRIPTS = [("eval/stream_study.py", ["--out", "{tmp}/out"]),
                  ("eval/scale_study.py", ["--smoke", "--out", "{tmp}/out"]),
                  ("scripts/sample.py", ["--model", "{tmp}/model", "--base", "dit", "--labels", "1",
                                         "--out", "{tmp}/out"]),
                  ("benchmarks/bench_dit_step.py", ["--tiny"]),
                  ("benchmarks/bench_wan_step.py", ["--tiny"]),
                  ("benchmarks/bench_host_overhead.py", []),
                  ("benchmarks/bench_attention.py", []),
                  ("scripts/extract_latents.py", ["--data", "{tmp}/data", "--out", "{tmp}/out"])]
BAD_DEVICES = ["gpu0", *(["cuda"] if not torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", BAD_DEVICES)
@pytest.mark.parametrize("script, argv", DEVICE_SCRIPTS, ids=[s for s, _ in DEVICE_SCRIPTS])
def test_every_device_flag_refuses_a_bad_name_or_a_missing_gpu(script, argv, device, tmp_path, capsys,
                                                                monkeypatch):
    """One check (``cli.device_setting``) behind every ``--device``: a name torch does not parse, or
    CUDA on a machine without it, is one line naming the flag and the value, before anything is written."""
    argv = [a.format(tmp=tmp_path) for a in argv]
    message = fails_in_one_line(script, [*argv, "--device", device], capsys, monkeypatch)
    assert "--device" in message and device in message, message
    assert not (tmp_path / "out").exists()


def test_device_setting_parses_names_and_picks_a_default(monkeypatch):
    from mhla_gen.commands.cli import device_setting
    from mhla_gen.errors import ConfigError

    assert device_setting("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_setting(None) == torch.device("cuda") and device_setting("cuda:1").index == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_setting(None) == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"--gpu cuda: no CUDA device here \(use the CPU\)"):
        device_setting("cuda", "--gpu", hint="use the CPU")
    with pytest.raises(ConfigError, match="--device 'tpu'"):
        device_setting("tpu")


def test_fid_never_writes_into_its_samples_or_reference_folders(tmp_path, capsys, monkeypatch):
    """``--out`` / ``--save-ref-stats`` inside the ``--samples`` or ``--ref`` folder (a user's images) is
    refused before any feature is extracted; beside them is fine (the default ``<samples>.fid.json``)."""
    for name in ("samples", "ref"):
        (tmp_path / name).mkdir()
        for i in range(2):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / name / f"{i}.png")
    common = ["--samples", str(tmp_path / "samples"), "--ref", str(tmp_path / "ref")]
    targets = [("--out", "samples/m.json", "--samples"), ("--out", "ref/m.json", "--ref"),
               ("--save-ref-stats", "ref/stats.npz", "--ref"),
               ("--save-ref-stats", "samples/stats", "--samples")]
    for setting, target, inside in targets:
        argv = [*common, setting, str(tmp_path / target)]
        line = fails_in_one_line("eval/fid.py", argv, capsys, monkeypatch)
        assert f"{setting}=" in line and f"is inside {inside}=" in line, line
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["0.png", "1.png"]
    assert sorted(p.name for p in (tmp_path / "ref").iterdir()) == ["0.png", "1.png"]
