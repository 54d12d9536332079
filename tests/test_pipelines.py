"""DiT / SANA pipelines with MHLA end to end on CPU (tiny models, 2 steps), and scripts/sample.py."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from script_helpers import load_script

from mhla_gen import MHLAConfig, install_mhla, mhla_parameters
from mhla_gen.pipelines.dit import check_class_labels, load_dit_pipeline
from mhla_gen.pipelines.sana import load_sana_pipeline
from mhla_gen.testing import tiny_dit_pipeline, tiny_sana_pipeline

REPO = Path(__file__).resolve().parents[1]

CFG = MHLAConfig(blocks=(2, 2), gate=True)


def perturb_mhla(transformer):
    torch.manual_seed(3)
    for p in mhla_parameters(transformer).values():
        p.data.uniform_(0.0, 0.5)


def run_dit(pipe, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return pipe(class_labels=[1, 2], num_inference_steps=2, generator=generator, output_type="np").images


def run_sana(pipe, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return pipe(
        "a red cat", num_inference_steps=2, height=32, width=32, generator=generator, output_type="np",
        use_resolution_binning=False, max_sequence_length=8, complex_human_instruction=None,
    ).images


@pytest.fixture(scope="module")
def dit_pipeline_dir(tmp_path_factory):
    """A tiny DiT pipeline with trained-looking MHLA, saved with save_pretrained, and its images."""
    pipe = tiny_dit_pipeline()
    install_mhla(pipe.transformer, CFG)
    perturb_mhla(pipe.transformer)
    folder = tmp_path_factory.mktemp("dit_pipe")
    pipe.save_pretrained(folder)
    return folder, run_dit(pipe)


def test_dit_pipeline_round_trip(dit_pipeline_dir):
    folder, images = dit_pipeline_dir
    pipe = load_dit_pipeline(folder)
    assert pipe.transformer.mhla_config == CFG
    out = run_dit(pipe)
    assert out.shape == (2, 16, 16, 3) and np.isfinite(out).all()
    np.testing.assert_array_equal(out, images)


def test_dit_pipeline_from_stock_plus_config(tmp_path):
    tiny_dit_pipeline().save_pretrained(tmp_path)
    pipe = load_dit_pipeline(tmp_path, mhla=CFG)
    assert pipe.transformer.mhla_config == CFG
    assert run_dit(pipe).shape == (2, 16, 16, 3)


def test_dit_pipeline_transformer_path_and_conflict(tmp_path, dit_pipeline_dir):
    folder, images = dit_pipeline_dir
    stock = tmp_path / "stock"
    tiny_dit_pipeline().save_pretrained(stock)
    pipe = load_dit_pipeline(stock, transformer_path=folder / "transformer")
    np.testing.assert_array_equal(run_dit(pipe), images)
    with pytest.raises(ValueError, match="refusing to replace"):
        load_dit_pipeline(folder, mhla=MHLAConfig(blocks=(4, 4)))


def test_dit_class_label_checks():
    transformer = tiny_dit_pipeline(num_embeds_ada_norm=10).transformer
    with pytest.raises(ValueError, match=r"class labels \[12\] out of range"):
        check_class_labels(transformer, [1, 12], guidance_scale=1.0)
    with pytest.raises(ValueError, match="null class"):
        check_class_labels(transformer, [1], guidance_scale=4.0)
    check_class_labels(transformer, [1], guidance_scale=1.0)


def test_sana_pipeline_round_trip(tmp_path):
    pipe = tiny_sana_pipeline()
    install_mhla(pipe.transformer, CFG)
    perturb_mhla(pipe.transformer)
    images = run_sana(pipe)
    assert images.shape == (1, 32, 32, 3) and np.isfinite(images).all()
    pipe.save_pretrained(tmp_path)
    loaded = load_sana_pipeline(tmp_path)
    assert loaded.transformer.mhla_config == CFG
    blocks = loaded.transformer.transformer_blocks
    assert all(type(b.attn2.processor).__name__ == "SanaAttnProcessor2_0" for b in blocks)
    np.testing.assert_array_equal(run_sana(loaded), images)
    with pytest.raises(ValueError, match="is a SanaTransformer2DModel, not a DiTTransformer2DModel"):
        load_dit_pipeline(tmp_path)


def _sample_module():
    return load_script(REPO / "scripts" / "sample.py", "sample_script")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--base", "dit", "--model", "x/y"], "needs --labels"),
        (["--base", "sana", "--model", "x/y", "--labels", "1"], "needs --prompt"),
        (["--base", "dit", "--model", "./missing", "--labels", "1"], "does not exist"),
        (["--base", "dit", "--model", "x/y", "--labels", "1", "--steps", "0"], "--steps must be"),
    ],
)
def test_sample_script_rejects_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit):
        _sample_module().parse_args(argv)
    assert message in capsys.readouterr().err


def test_sample_script_names_a_cut_weight_file(tmp_path, capsys):
    """A --transformer (or --model's transformer/) whose safetensors file was cut short: one line naming
    the setting and the file, before the pipeline loads."""
    from mhla_gen.testing import tiny_dit

    tiny_dit().save_pretrained(tmp_path / "pipe" / "transformer")
    weights = tmp_path / "pipe" / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    for flags in (["--model", "x/y", "--transformer", str(tmp_path / "pipe" / "transformer")],
                  ["--model", str(tmp_path / "pipe")]):
        with pytest.raises(SystemExit):
            _sample_module().parse_args(["--base", "dit", "--labels", "1", *flags])
        assert "is not a readable safetensors file" in capsys.readouterr().err


def test_sample_script_end_to_end(tmp_path, dit_pipeline_dir):
    folder, _ = dit_pipeline_dir
    out = tmp_path / "samples"
    cmd = [sys.executable, "scripts/sample.py", "--base", "dit", "--model", str(folder),
           "--labels", "1", "2", "3", "--steps", "2", "--guidance", "2", "--device", "cpu", "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    grid = Image.open(out / "dit_seed0_grid.png")
    assert grid.size == (3 * 16, 16)
    assert sorted(p.name for p in out.glob("dit_seed0_0*.png")) == [
        "dit_seed0_00_1.png", "dit_seed0_01_2.png", "dit_seed0_02_3.png"
    ]


def test_sample_says_when_the_model_runs_no_mhla(tmp_path, dit_pipeline_dir, capsys):
    """A stock pipeline without --transformer or --blocks samples the base's own attention: allowed (a
    softmax teacher), but said on stderr, not silent; an MHLA model gets no note."""
    tiny_dit_pipeline().save_pretrained(tmp_path / "stock")
    common = ["--base", "dit", "--labels", "1", "--steps", "1", "--device", "cpu"]
    capsys.readouterr()
    _sample_module().main([*common, "--model", str(tmp_path / "stock"), "--out", str(tmp_path / "a")])
    assert "has no MHLA: sampling the base's own attention" in capsys.readouterr().err
    _sample_module().main([*common, "--model", str(dit_pipeline_dir[0]), "--out", str(tmp_path / "b")])
    _sample_module().main([*common, "--model", str(tmp_path / "stock"), "--blocks", "2", "2",
                           "--out", str(tmp_path / "c")])
    assert "no MHLA" not in capsys.readouterr().err


@pytest.mark.slow
def test_pipelines_import_from_any_directory(tmp_path):
    """mhla_gen.pipelines is a plain subpackage (no repo root on sys.path needed), and the top-level name
    `pipelines` is left to other projects."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib.util, mhla_gen.pipelines, mhla_gen.pipelines.dit, mhla_gen.pipelines.sana, "
            "mhla_gen.pipelines.wan; print(mhla_gen.pipelines.__file__); "
            "print(importlib.util.find_spec('pipelines'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    new, old = result.stdout.split()
    assert Path(new).parent.name == "pipelines" and Path(new).parent.parent.name == "mhla_gen"
    assert old == "None"


def test_loading_a_float32_transformer_as_float32_casts_nothing(tmp_path, dit_pipeline_dir):
    """sample.py's default fp32 load of a saved transformer: no `.to(dtype)` (diffusers warns on every one,
    'modules that should be kept in float32: []')."""
    import logging

    from diffusers.utils import logging as diffusers_logging

    folder, _ = dit_pipeline_dir
    transformer = load_dit_pipeline(folder).transformer
    install_mhla(transformer, MHLAConfig(blocks=(2, 2))).save_pretrained(tmp_path / "final")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    diffusers_logging.get_logger("diffusers").addHandler(handler)
    try:
        pipe = load_dit_pipeline(folder, torch_dtype=torch.float32, transformer_path=tmp_path / "final")
    finally:
        diffusers_logging.get_logger("diffusers").removeHandler(handler)
    assert pipe.transformer.dtype == torch.float32
    assert not [r for r in records if "kept in float32" in r.getMessage()]
    assert load_dit_pipeline(folder, torch_dtype=torch.float16, transformer_path=tmp_path / "final") \
        .transformer.dtype == torch.float16


def test_video_samplers_refuse_frames_the_vae_cannot_encode():
    """Wan and SANA-Video: ``--frames`` must be ``4k + 1`` (the VAE's temporal factor), one clear error."""
    from mhla_gen.errors import ConfigError
    from mhla_gen.pipelines import SampleSettings
    from mhla_gen.pipelines.sana_video import SanaVideoSampler
    from mhla_gen.pipelines.wan import WanSampler
    from mhla_gen.testing.video import tiny_sana_video_pipeline
    from mhla_gen.testing.wan import tiny_wan_pipeline

    for sampler, pipe, size in ((WanSampler, tiny_wan_pipeline(), (32, 32)),
                                (SanaVideoSampler, tiny_sana_video_pipeline(), (32, 64))):
        with pytest.raises(ConfigError, match=r"--frames 6 must be 4k \+ 1"):
            sampler.fit_size(pipe, SampleSettings(height=size[0], width=size[1], frames=6))
        assert sampler.fit_size(pipe, SampleSettings(height=size[0], width=size[1], frames=5)).frames == 5
