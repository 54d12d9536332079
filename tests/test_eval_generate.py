"""eval/generate.py: a tiny digits DiT run -> PNGs, manifest, ADM npz; resume redoes only what is missing."""

import json
from pathlib import Path

import numpy as np
import pytest
from script_helpers import load_script
from train_helpers import tiny_config

from mhla_gen.bases import BASES

ROOT = Path(__file__).resolve().parents[1]
CAPTIONED = [name for name, base in BASES.items() if not base.class_conditional]  # DiT's labels: above


def load(name):
    return load_script(ROOT / "eval" / f"{name}.py", f"eval_{name}")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A digits DiT-MHLA 'training run' folder (config.yaml + final/) with untrained weights."""
    from mhla_gen.train.config import DiTRunConfig, config_to_yaml, load_config
    from mhla_gen.train.dit import DiTTask

    run = tmp_path_factory.mktemp("run")
    cfg = load_config(DiTRunConfig, ROOT / "mhla_gen" / "configs" / "dit_digits.yaml", [
        f"output_dir={run}", "data.resolution=8", "model.hidden_size=16", "model.depth=1", "model.heads=2"])
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    DiTTask(cfg).build_transformer().save_pretrained(run / "final")
    return run


def test_generate_files_manifest_npz_and_resume(tiny_run, tmp_path):
    gen = load("generate")
    out = tmp_path / "samples"
    args = ["base=dit", f"run_config={tiny_run / 'config.yaml'}", f"output_dir={out}", "labels=[0,3,7]",
            "num_per_item=2", "steps=2", "batch_size=4"]
    gen.main(args)
    files = sorted(out.glob("*.png"))
    assert [f.name for f in files] == [f"{i:06d}.png" for i in range(6)]
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [m["label"] for m in manifest] == [0, 0, 3, 3, 7, 7]
    assert [m["seed"] for m in manifest] == list(range(6))
    assert len({m["config_hash"] for m in manifest}) == 1 and not list(out.glob("manifest.*.jsonl"))
    npz = np.load(out / "samples.npz")
    assert npz["arr_0"].shape == (6, 8, 8, 3) and npz["arr_0"].dtype == np.uint8
    assert npz["arr_1"].tolist() == [0, 0, 3, 3, 7, 7]

    # resume: delete two samples; only those are regenerated, bit-identical (per-sample seeds)
    before = {f.name: f.read_bytes() for f in files}
    mtimes = {f.name: f.stat().st_mtime_ns for f in files}
    (out / "000001.png").unlink()
    (out / "000004.png").unlink()
    gen.main(args + ["batch_size=1"])  # batch size does not change the samples or the hash
    after = {f.name: f.read_bytes() for f in sorted(out.glob("*.png"))}
    assert after == before
    untouched = {n: t for n, t in mtimes.items() if n not in ("000001.png", "000004.png")}
    assert all(out.joinpath(n).stat().st_mtime_ns == t for n, t in untouched.items())
    # the sample set scores with eval/fid.py (digits extractor)
    metrics = load("fid").main(["--samples", str(out / "samples.npz"), "--ref", "digits",
                                "--kid-subsets", "5", "--k", "2"])
    assert metrics["num_samples"] == 6 and np.isfinite(metrics["fid"])

    with pytest.raises(ValueError, match="another config"):
        gen.main(args + ["steps=3"])


def test_generate_config_errors():
    gen = load("generate")
    with pytest.raises(ValueError, match="labels"):
        gen.load_generate_config(None, ["base=dit", "run_config=x.yaml"])
    with pytest.raises(ValueError, match="prompts"):
        gen.load_generate_config(None, ["base=wan", "model=x"])
    with pytest.raises(ValueError, match=r"seed must be in 0\.\.2\*\*32-1, got -1"):
        gen.load_generate_config(None, ["base=dit", "model=x", "labels=[1]", "seed=-1"])


def test_generate_refuses_a_prompts_file_without_prompts(tmp_path):
    """A blank prompts file gave an empty sample set (a marked folder, config.yaml, an empty manifest) and
    exit status 0; a missing one an OSError without the setting's name."""
    from mhla_gen.errors import ConfigError
    from mhla_gen.testing.wan import tiny_wan_pipeline

    tiny_wan_pipeline().save_pretrained(tmp_path / "wan")
    (tmp_path / "blank.txt").write_text("\n   \n")
    out = tmp_path / "samples"
    common = ["base=wan", f"model={tmp_path / 'wan'}", f"output_dir={out}", "height=16", "width=16",
              "num_frames=5", "steps=1"]
    with pytest.raises(ConfigError, match=r"prompts_file=.*blank\.txt' holds no prompts"):
        load("generate").main([*common, f"prompts_file={tmp_path / 'blank.txt'}"])
    with pytest.raises(FileNotFoundError, match=r"prompts_file=.*missing\.txt' does not exist"):
        load("generate").main([*common, f"prompts_file={tmp_path / 'missing.txt'}"])
    assert not out.exists()


@pytest.mark.parametrize("base", CAPTIONED)
def test_generate_and_score_every_captioned_base(base, tmp_path):
    """A saved tiny pipeline of the base (random weights, MHLA installed) -> its sample files of the asked
    size, a manifest (prompt and seed per sample), and the scores of its kind: samples.npz without labels for
    images (the two seeds differ), eval/vbench.py for videos."""
    import inspect

    from mhla_gen import install_mhla
    from mhla_gen.metrics.video import read_video
    from mhla_gen.train.config import load_config

    record, tiny = BASES[base], BASES[base].tiny.load()
    pipe = tiny.pipeline(install_mhla(tiny.model(), tiny.mhla))
    pipe.save_pretrained(tmp_path / "pipe")
    *frames, height, width = tiny.pixels
    tokens = load_config(record.run_config.load(), tiny_config(record)).data.max_sequence_length
    args = [f"height={height}", f"width={width}", *[f"num_frames={f}" for f in frames], "steps=2",
            "prompts=[a red cat]", "num_per_item=2", "guidance_scale=1.0", "fps=8", "batch_size=2",
            f"max_sequence_length={tokens}"]
    if "complex_human_instruction" in inspect.signature(type(pipe).__call__).parameters:
        args.append("extra={complex_human_instruction: null}")  # SANA's long system prompt: off
    if record.image_conditioned:
        from PIL import Image

        Image.new("RGB", (width, height), (200, 30, 30)).save(tmp_path / "first.png")
        args.append(f"images=[{tmp_path / 'first.png'}]")
    out = tmp_path / "samples"
    load("generate").main([f"base={base}", f"model={tmp_path / 'pipe'}", f"output_dir={out}", *args])
    suffix = record.sample_suffix
    assert sorted(f.name for f in out.glob(f"*{suffix}")) == [f"00000{i}{suffix}" for i in range(2)]
    assert (out / "samples.npz").exists() != record.video
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [(m["prompt"], m["seed"]) for m in manifest] == [("a red cat", 0), ("a red cat", 1)]
    if record.video:
        video, fps = read_video(out / "000001.mp4")
        assert video.shape == (*frames, height, width, 3) and fps == 8.0
        assert load("vbench").main(["--videos", str(out)])["num_videos"] == 2
    else:
        npz = np.load(out / "samples.npz")
        assert npz["arr_0"].shape == (2, height, width, 3) and "arr_1" not in npz.files
        assert not np.array_equal(npz["arr_0"][0], npz["arr_0"][1])  # seeds 0 and 1 differ


@pytest.mark.parametrize("override, message", [
    ("num_per_item=0", "num_per_item must be >= 1"),
    ("batch_size=0", "batch_size must be >= 1"),
    ("steps=0", "steps must be >= 1"),
    ("labels=[-1,2]", "labels must be class ids >= 0"),
    ("labels=[3,10,12]", r"labels \[10, 12\] are outside the model's classes 0\.\.9"),
    ("stepz=3", r"on the command line: Key 'stepz'"),
])
def test_generate_bad_settings_fail_before_any_work(tiny_run, tmp_path, override, message):
    from mhla_gen.errors import ConfigError

    gen = load("generate")
    out = tmp_path / "samples"
    with pytest.raises(ConfigError, match=message):
        gen.main(["base=dit", f"run_config={tiny_run / 'config.yaml'}", f"output_dir={out}", "labels=[0]",
                  override])
    assert not out.exists()


def test_generate_weights_that_do_not_load_leave_no_folder(tiny_run, tmp_path):
    """A weight file cut short is refused in one line (its header read) and any that fails to load does so
    before output_dir is marked or its config.yaml written."""
    import shutil

    run = shutil.copytree(tiny_run, tmp_path / "run")
    weights = run / "final" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a download cut short
    out = tmp_path / "samples"
    from mhla_gen.errors import ConfigError

    with pytest.raises(ConfigError, match=r"run_config: .*safetensors' is not a readable safetensors file"):
        load("generate").main(["base=dit", f"run_config={run / 'config.yaml'}", f"output_dir={out}",
                               "labels=[0]", "steps=1"])
    assert not out.exists()
    weights.write_bytes((tiny_run / "final" / weights.name).read_bytes()[:-8])  # the data cut, not the header
    with pytest.raises(ConfigError, match=r"not a readable safetensors file \(.*not fully covered"):
        load("generate").main(["base=dit", f"run_config={run / 'config.yaml'}", f"output_dir={out}",
                               "labels=[0]", "steps=1"])
    assert not out.exists()
    from safetensors.torch import load_file, save_file

    whole = load_file(str(tiny_run / "final" / weights.name))
    save_file(dict(list(whole.items())[1:]), str(weights))  # a whole file, one tensor short: fails to load
    with pytest.raises(Exception, match=r"(?i)missing|size|load"):
        load("generate").main(["base=dit", f"run_config={run / 'config.yaml'}", f"output_dir={out}",
                               "labels=[0]", "steps=1"])
    assert not out.exists()  # the sampler loaded before the folder was marked


def test_generate_on_two_ranks_matches_one_process(tiny_run, tmp_path):
    """Two gloo ranks (torchrun) shard the items, each loads the weights before rank 0 marks the folder,
    and the assembled set is the one a single process draws (per-sample seeds)."""
    from train_helpers import run_torchrun

    args = ["base=dit", f"run_config={tiny_run / 'config.yaml'}", "labels=[0,3,7]", "num_per_item=2",
            "steps=2", "batch_size=2"]
    load("generate").main([*args, f"output_dir={tmp_path / 'one'}"])
    result = run_torchrun("../eval/generate.py", *args, f"output_dir={tmp_path / 'two'}")
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = (np.load(tmp_path / name / "samples.npz") for name in ("one", "two"))
    assert np.array_equal(one["arr_1"], two["arr_1"]) and np.array_equal(one["arr_0"], two["arr_0"])
    manifest = [json.loads(line) for line in (tmp_path / "two" / "manifest.jsonl").read_text().splitlines()]
    assert [m["seed"] for m in manifest] == list(range(6))
    assert not list((tmp_path / "two").glob("manifest.*.jsonl"))  # the shards were assembled and removed


def test_generate_refuses_ranks_that_would_each_run_alone(tiny_run, tmp_path, monkeypatch):
    """A launch of two ranks that Accelerate runs as two lone processes (torchrun on CPU without
    ACCELERATE_USE_CPU) would write every sample twice into one folder: refused before any write."""
    from mhla_gen.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)  # with it, Accelerate would try to join ranks
    out = tmp_path / "samples"
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=2 but Accelerate sees a single process.*"
                                          r"torchrun --nproc_per_node 2 eval/generate\.py"):
        load("generate").main(["base=dit", f"run_config={tiny_run / 'config.yaml'}", f"output_dir={out}",
                               "labels=[0]", "steps=1"])
    assert not out.exists()


def test_generate_refuses_a_folder_that_is_not_a_sample_set(tiny_run, tmp_path):
    from mhla_gen.errors import ConfigError

    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "000000.png").write_bytes(b"my photo")  # a name generate.py writes...
    (tmp_path / "photos" / "holiday.jpg").write_bytes(b"mine")  # ...in a folder that is not ours
    with pytest.raises(ConfigError, match=r"output_dir=.*photos.* not written by mhla_gen.*holiday\.jpg"):
        load("generate").main(["base=dit", f"run_config={tiny_run / 'config.yaml'}", "labels=[0]", "steps=1",
                               f"output_dir={tmp_path / 'photos'}"])
    assert (tmp_path / "photos" / "000000.png").read_bytes() == b"my photo"


def test_generate_latent_space_run_decodes_with_its_vae(tmp_path):
    """A run trained in latent space (data.vae) samples through its VAE: RGB at the data's pixel
    resolution, not the latents themselves (4 channels at half the size)."""
    from mhla_gen.testing import tiny_autoencoder_kl
    from mhla_gen.train.config import DiTRunConfig, config_to_yaml, load_config
    from mhla_gen.train.dit import DiTTask

    tiny_autoencoder_kl().save_pretrained(tmp_path / "vae")  # 2x spatial compression, 4 channels
    (tmp_path / "data" / "a").mkdir(parents=True)
    run = tmp_path / "run"
    cfg = load_config(DiTRunConfig, ROOT / "mhla_gen" / "configs" / "dit_digits.yaml", [
        f"output_dir={run}", "data.source=folder", f"data.path={tmp_path / 'data'}",
        f"data.vae={tmp_path / 'vae'}", "data.resolution=16", "model.num_classes=2",
        "model.hidden_size=16", "model.depth=1", "model.heads=2", "model.patch_size=2"])
    run.mkdir()
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    DiTTask(cfg).build_transformer().save_pretrained(run / "final")
    out = tmp_path / "samples"
    load("generate").main(["base=dit", f"run_config={run / 'config.yaml'}", f"output_dir={out}",
                           "labels=[0,1]", "steps=2"])
    assert np.load(out / "samples.npz")["arr_0"].shape == (2, 16, 16, 3)


def test_generate_a_wan22_a14b_pipeline_with_both_experts(tmp_path):
    """Wan2.2 A14B (two experts, both with MHLA, loaded from the saved pipeline): MP4s through the wan
    record, fps as asked."""
    import torch

    from mhla_gen import MHLAConfig, install_mhla
    from mhla_gen.integration.install import is_mhla_installed
    from mhla_gen.metrics.video import read_video
    from mhla_gen.pipelines.wan import load_wan_pipeline
    from mhla_gen.testing.video import tiny_wan22_pipeline, tiny_wan_expert

    experts = [install_mhla(tiny_wan_expert(seed), MHLAConfig(blocks=(1, 2, 2))) for seed in (0, 1)]
    tiny_wan22_pipeline(*experts).save_pretrained(tmp_path / "pipe")
    out = tmp_path / "videos"
    load("generate").main([f"base={BASES['wan'].name}", f"model={tmp_path / 'pipe'}", f"output_dir={out}",
                           "prompts=[a cat,a dog]", "height=32", "width=32", "num_frames=5", "steps=2",
                           "guidance_scale=1.0", "fps=8", "max_sequence_length=8"])
    frames, fps = read_video(out / "000001.mp4")
    assert frames.shape == (5, 32, 32, 3) and fps == 8.0
    loaded = load_wan_pipeline(tmp_path / "pipe", torch_dtype=torch.float32)
    assert is_mhla_installed(loaded.transformer) and is_mhla_installed(loaded.transformer_2)
