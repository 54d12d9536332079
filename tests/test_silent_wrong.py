"""Settings that ran to a wrong result with exit 0, or failed only after writing (issue 54, part 5).

Each case is refused before the first write: the output folder does not exist afterwards (or is unchanged,
byte for byte), and the message names the setting.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_cli_errors import fails_in_one_line
from test_ownership import checksums, load_script
from train_helpers import run_inprocess, tiny_config, training_script, write_captioned_videos

from mhla_gen import MHLAConfig, install_mhla
from mhla_gen.bases import BASES, base_for
from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import input_record, write_marker
from mhla_gen.train.config import load_config

DIT, SANA = BASES["dit"], BASES["sana"]
DIT_CONFIG, SANA_CONFIG = tiny_config(DIT), tiny_config(SANA)
FINE_TUNED = [name for name, base in BASES.items() if base.trains and not base.class_conditional]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny checkpoint of each fine-tuned base, and a stage-1 ``final/`` converted from it (an MHLA
    transformer whose marker records the checkpoint as its teacher, as scripts/linearize.py writes it)."""
    root = tmp_path_factory.mktemp("checkpoints")
    for base in FINE_TUNED:
        pipe = BASES[base].tiny.load().pipeline()
        pipe.save_pretrained(root / base / "ckpt")
        blocks = (1, 2, 2) if base_for(base).video else (2, 2)
        install_mhla(pipe.transformer, MHLAConfig(blocks=blocks))
        final = root / base / "stage1" / "final"
        pipe.transformer.save_pretrained(final)
        teacher = str((root / base / "ckpt").resolve())
        write_marker(final, "model", teacher=teacher, teacher_record=input_record(teacher),
                     stage="attention transfer")
    return root


def _task(base: str, root: Path, *overrides: str):
    schema = base_for(base).run_config.load()
    cfg = load_config(schema, tiny_config(base), [f"model.pretrained={root / base / 'ckpt'}",
                                       f"model.init_from={root / base / 'stage1' / 'final'}",
                                       "train.distill.output_weight=1", *overrides])
    return base_for(base).task.load()(cfg)


# ----------------------------------------------------------------------- the teacher a stage-1 folder records
@pytest.mark.parametrize("base", FINE_TUNED)
def test_stage2_distils_from_the_recorded_teacher_and_refuses_one_that_changed(checkpoints, tmp_path, base):
    """SANA / Wan / SANA-Video / Wan I2V followed model.pretrained: another checkpoint, a changed one or a
    record of an earlier version were all accepted. Now as DiT: the recorded teacher, checked."""
    root = tmp_path / "root"
    shutil.copytree(checkpoints / base, root / base)
    recorded = str((root / base / "ckpt").resolve())
    record = input_record(recorded)
    write_marker(root / base / "stage1" / "final", "model", teacher=recorded, teacher_record=record)
    assert _task(base, root).distill_source() == recorded
    other = tmp_path / "other"  # the same model elsewhere: the recorded teacher is still the one used
    shutil.copytree(root / base / "ckpt", other)
    assert _task(base, root, f"model.pretrained={other}").distill_source() == recorded
    assert _task(base, root, f"train.distill.teacher={other}").distill_source() == str(other)  # named

    weights = next((root / base / "ckpt" / "transformer").glob("*.safetensors"))
    original = weights.read_bytes()
    weights.write_bytes(original[:-4] + bytes(b ^ 0xFF for b in original[-4:]))  # retrained, same size
    with pytest.raises(ConfigError, match="has changed since it was recorded.*train.distill.teacher=PATH"):
        _task(base, root).distill_source()
    weights.write_bytes(original)
    write_marker(root / base / "stage1" / "final", "model", teacher="ckpt")  # an earlier version's record
    with pytest.raises(ConfigError, match="recorded without its resolved path"):
        _task(base, root).distill_source()


def test_a_changed_teacher_stops_stage2_before_anything_is_written(checkpoints, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(checkpoints / SANA.name, root / SANA.name)
    recorded = str((root / SANA.name / "ckpt").resolve())
    write_marker(root / SANA.name / "stage1" / "final", "model", teacher=recorded,
                 teacher_record=input_record(recorded))
    weights = next((root / SANA.name / "ckpt" / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (32, 32)).save(data / "0.png")
    (data / "0.txt").write_text("a cat")
    with pytest.raises(ConfigError, match="has changed since it was recorded"):
        run_inprocess(training_script(SANA), "--config", SANA_CONFIG,
                      f"model.pretrained={root / SANA.name / 'ckpt'}",
                      f"model.init_from={root / SANA.name / 'stage1' / 'final'}", f"data.path={data}",
                      "train.distill.output_weight=1", f"output_dir={tmp_path / 'run'}")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------- non-finite settings
@pytest.mark.parametrize("override, message", [
    ("train.learning_rate=inf", "train.learning_rate must be a finite number > 0, got inf"),
    ("train.learning_rate=nan", "train.learning_rate must be a finite number > 0, got nan"),
    ("train.learning_rate=0", "train.learning_rate must be a finite number > 0"),
    ("train.distill.output_weight=nan", "train.distill.output_weight=nan must be a finite number"),
    ("mhla.eps=inf", "mhla.eps=inf must be a finite number"),
    ("diffusion.beta_end=inf", "diffusion.beta_end=inf must be a finite number"),
])
def test_non_finite_settings_are_refused_before_any_work(override, message, tmp_path, capsys, monkeypatch):
    """train.learning_rate=inf trained to all-NaN weights with exit 0."""
    line = fails_in_one_line("scripts/train_dit.py", ["--config", DIT_CONFIG, override,
                             f"output_dir={tmp_path / 'run'}"], capsys, monkeypatch)
    assert message in line and not (tmp_path / "run").exists()


def test_non_finite_numbers_in_nested_settings_are_named():
    from mhla_gen.train.config import SanaRunConfig

    with pytest.raises(ConfigError, match=r"flow\.logit_std=inf must be a finite number"):
        load_config(SanaRunConfig, None, ["model.pretrained=x", "flow.logit_std=inf"])


# -------------------------------------------------------------------------------- data.split of a saved set
def test_data_split_of_a_single_saved_dataset_is_honoured_or_refused(tmp_path):
    """data.split=validation on a save_to_disk Dataset was ignored: it trained on whatever the folder held."""
    import datasets

    from mhla_gen.data.hf_datasets import load_hf_dataset

    datasets.Dataset.from_dict({"x": [1, 2]}).save_to_disk(str(tmp_path / "unnamed"))
    datasets.Dataset.from_dict({"x": [3]}, split="validation").save_to_disk(str(tmp_path / "val"))
    assert len(load_hf_dataset(str(tmp_path / "unnamed"), "train")) == 2
    assert load_hf_dataset(str(tmp_path / "val"), "validation")["x"] == [3]
    with pytest.raises(ConfigError, match=r"data.split='validation', but .* one unnamed split"):
        load_hf_dataset(str(tmp_path / "unnamed"), "validation")
    with pytest.raises(ConfigError, match=r"holding the 'validation' split.*set data.split=validation"):
        load_hf_dataset(str(tmp_path / "val"), "train")


def test_data_split_refusal_comes_before_any_write(checkpoints, tmp_path):
    import datasets

    image = Image.new("RGB", (32, 32))
    datasets.Dataset.from_dict({"image": [image], "text": ["a cat"]}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="data.split='validation'"):
        run_inprocess(training_script(SANA), "--config", SANA_CONFIG,
                      f"model.pretrained={checkpoints / 'sana' / 'ckpt'}", "data.source=hf",
                      f"data.path={tmp_path / 'hf'}", "data.split=validation",
                      f"output_dir={tmp_path / 'run'}")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- a latent cache's resolution
def test_a_run_on_a_latent_cache_records_the_caches_resolution(tmp_path):
    """config.yaml said data.resolution=256 (the default) for a cache of 16 px images."""
    from mhla_gen.testing import tiny_autoencoder_kl
    from mhla_gen.train.config import DiTRunConfig
    from mhla_gen.train.dit import DiTTask

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / "classes" / c).mkdir(parents=True)
        pixels = rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / "classes" / c / "0.png")
    tiny_autoencoder_kl().save_pretrained(tmp_path / "vae")
    load_script("scripts/extract_latents.py").main(["--data", str(tmp_path / "classes"), "--out",
                                                    str(tmp_path / "cache"), "--vae", str(tmp_path / "vae"),
                                                    "--resolution", "16", "--device", "cpu"])
    overrides = ["data.source=latents", f"data.path={tmp_path / 'cache'}", f"data.vae={tmp_path / 'vae'}",
                 "model.num_classes=2", "data.resolution=256"]
    cfg = load_config(DiTRunConfig, DIT_CONFIG, overrides)
    assert DiTTask(cfg).run_config().data.resolution == 16


# ------------------------------------------------------------------------- sampling: refused before writing
@pytest.fixture(scope="module")
def dit_models(tmp_path_factory):
    """A tiny latent DiT pipeline (4-channel VAE), a pixel-space MHLA DiT folder (3 channels) and a latent
    one (4 channels), both with 2x2 blocks."""
    from mhla_gen.testing import tiny_dit, tiny_dit_pipeline

    root = tmp_path_factory.mktemp("dit_models")
    tiny_dit_pipeline().save_pretrained(root / "pipe")
    pixels = tiny_dit(in_channels=3, out_channels=6)
    install_mhla(pixels, MHLAConfig(blocks=(2, 2)))
    pixels.save_pretrained(root / "pixels")
    latent = tiny_dit()
    install_mhla(latent, MHLAConfig(blocks=(2, 2)))
    latent.save_pretrained(root / "latent")
    return root


def test_sample_and_generate_refuse_a_pixel_space_dit_in_a_latent_pipeline(dit_models, tmp_path, capsys,
                                                                          monkeypatch):
    """Both denoised, then crashed in the VAE decode with the output folder written."""
    line = fails_in_one_line("scripts/sample.py", ["--base", "dit", "--model", str(dit_models / "pipe"),
                             "--transformer", str(dit_models / "pixels"), "--labels", "0", "--steps", "1",
                             "--out", str(tmp_path / "s")], capsys, monkeypatch)
    assert "is a DiT on 3-channel inputs, but the VAE of --model makes 4-channel latents" in line
    line = fails_in_one_line("eval/generate.py", ["base=dit", f"model={dit_models / 'pipe'}", "labels=[0]",
                             f"transformer={dit_models / 'pixels'}", "steps=1",
                             f"output_dir={tmp_path / 'g'}"], capsys, monkeypatch)
    assert "3-channel inputs" in line and "eval/generate.py run_config=" in line
    assert not (tmp_path / "s").exists() and not (tmp_path / "g").exists()


@pytest.mark.parametrize("args, message", [
    (["mhla={blocks: [8, 8]}"], r"mhla: MHLA blocks \(8, 8\) do not fit the token grid \(4, 4\)"),
    (["transformer={root}/latent", "mhla={blocks: [1, 1]}"], r"mhla: transformer=.* was saved with MHLA"),
])
def test_generate_refuses_blocks_that_do_not_fit_before_writing(dit_models, tmp_path, capsys, monkeypatch,
                                                                 args, message):
    """generate.py marked output_dir and wrote its config.yaml, then the first forward refused the blocks."""
    import re

    out = tmp_path / "g"
    out.mkdir()  # an existing folder of ours: unchanged by the refusal
    write_marker(out, "samples")
    before = checksums(out)
    args = [a.replace("{root}", str(dit_models)) for a in args]
    line = fails_in_one_line("eval/generate.py", ["base=dit", f"model={dit_models / 'pipe'}", "labels=[0]",
                             "steps=1", *args, f"output_dir={out}"], capsys, monkeypatch)
    assert re.search(message, line), line
    assert checksums(out) == before


@pytest.mark.parametrize("base", FINE_TUNED)
def test_generate_checks_the_grid_of_every_base(checkpoints, tmp_path, capsys, monkeypatch, base):
    """Blocks twice the token grid of the tiny sampling size on every axis: refused, naming the grid the
    pipeline's own latents of that size have (the tiny sampling call's, over the patch)."""
    import torch

    record, tiny = BASES[base], BASES[base].tiny.load()
    pipe = tiny.pipeline()
    latents = tiny.sample(pipe, torch.Generator().manual_seed(0))
    patch = pipe.transformer.config[record.grid.patch]
    patch = (patch,) * record.grid.ndim if isinstance(patch, int) else tuple(patch)
    grid = tuple(n // p for n, p in zip(latents.shape[2:], patch))
    *frames, height, width = tiny.pixels
    args = [f"height={height}", f"width={width}", *[f"num_frames={f}" for f in frames],
            f"mhla={{blocks: {[2 * n for n in grid]}}}",
            "max_sequence_length=512"]  # what every text encoder takes (Wan2.1 I2V: exactly 512)
    if record.image_conditioned:
        Image.new("RGB", (width, height)).save(tmp_path / "first.png")
        args.append(f"images=[{tmp_path / 'first.png'}]")
    line = fails_in_one_line("eval/generate.py", [f"base={base}", f"model={checkpoints / base / 'ckpt'}",
                             "prompts=[a cat]", "steps=1", *args, f"output_dir={tmp_path / 'g'}"],
                             capsys, monkeypatch)
    assert f"do not fit the token grid {grid}" in line and not (tmp_path / "g").exists()


# ------------------------------------------------------------------------------- no readable training item
def _broken_images(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for i in range(2):
        (folder / f"{i}.png").write_bytes(b"not a png")
        (folder / f"{i}.txt").write_text("a cat")
    return folder


def _broken_videos(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for i in range(2):
        (folder / f"{i}.mp4").write_bytes(b"not an mp4")
        (folder / f"{i}.txt").write_text("a cat")
    return folder


@pytest.mark.parametrize("base", [name for name in FINE_TUNED if "folder" in BASES[name].data_sources])
def test_no_readable_item_is_refused_before_config_marker_and_cache(checkpoints, tmp_path, base, capsys,
                                                                    monkeypatch):
    """The refusal came after config.yaml, the run marker and a temporary cache were written."""
    data = (_broken_videos if base_for(base).video else _broken_images)(tmp_path / "data")
    line = fails_in_one_line(f"scripts/{training_script(base)}", ["--config", tiny_config(base),
                             f"model.pretrained={checkpoints / base / 'ckpt'}", f"data.path={data}",
                             f"output_dir={tmp_path / 'run'}"], capsys, monkeypatch)
    assert f"data.path={str(data)!r}: none of its 2 captioned" in line and "can be read" in line
    assert not (tmp_path / "run").exists()


def test_no_readable_item_of_a_datasets_dataset_is_refused_before_writing(checkpoints, tmp_path):
    import datasets

    table = {"image": [b"not a png", b"nor this"], "text": ["a cat", "a dog"], "label": [0, 1]}
    datasets.Dataset.from_dict(table).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="none of its 2 captioned images can be read"):
        run_inprocess(training_script(SANA), "--config", SANA_CONFIG,
                      f"model.pretrained={checkpoints / 'sana' / 'ckpt'}", "data.source=hf",
                      f"data.path={tmp_path / 'hf'}", f"output_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match="none of its 2 'image' images can be read"):
        run_inprocess("train_dit.py", "--config", DIT_CONFIG, "data.source=hf",
                      f"data.path={tmp_path / 'hf'}", "model.num_classes=2", "data.vae=null",
                      f"output_dir={tmp_path / 'dit'}")
    assert not (tmp_path / "run").exists() and not (tmp_path / "dit").exists()


def test_a_readable_video_among_broken_ones_is_enough(checkpoints, tmp_path):
    """The check stops at the first readable item (a bad file is skipped while training, as before)."""
    from mhla_gen.data.images import check_readable
    from mhla_gen.data.videos import CaptionedVideoFolder

    data = write_captioned_videos(tmp_path / "data")
    (data / "0.mp4").write_bytes(b"broken")
    check_readable(CaptionedVideoFolder(data, 5, 32, 32), "data.path", data)


def test_dit_refuses_a_non_square_latent_before_attending():
    """A 6 x 24 latent at patch 2 is a 3 x 12 token grid of 36 tokens, which DiT's self-attention (it sees
    ``(B, N, C)``) would take as the square 6 x 6: refused by the install's pre-hook, naming both grids."""
    import torch

    tiny = DIT.tiny.load()
    model = install_mhla(tiny.model(), MHLAConfig(blocks=(3, 3)))
    latent = torch.randn(1, model.config.in_channels, 6, 24)
    with pytest.raises(ValueError, match=r"square latents only.*3 x 12"):
        labels = torch.zeros(1, dtype=torch.long)
        model(latent, timestep=labels, class_labels=labels)
