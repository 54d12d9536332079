"""Nothing lost (issue 38): inputs and outputs apart, deletion only of what a writer listed,
``adopt`` that proves content, recorded teachers that cannot drift, one writer per folder, and the
remaining early crashes. Every case of the issue is a test here; user bytes are compared by checksum.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_cli_errors import TINY_SANA, fails_in_one_line
from test_ownership import TINY_DIT, assets, checksums, load_script, refused, user_files  # noqa: F401
from train_helpers import PYTHON, REPO, run_inprocess, running, subprocess_env

from mhla_gen.bases import BASES
from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import LISTING, MARKER, listed, read_marker, write_marker


def linearize(*args):
    run_inprocess("linearize.py", *args)


def train_dit(*args):
    run_inprocess("train_dit.py", "--config", TINY_DIT, *args)


# ------------------------------------------------------------------------- 1. inputs and outputs apart
@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """A finished softmax DiT run (the teacher) and a stage-1 run converted from it."""
    root = tmp_path_factory.mktemp("teacher")
    train_dit(f"output_dir={root / 'teacher'}", "model.attention=softmax", "train.max_steps=1")
    linearize("--config", TINY_DIT, f"model.init_from={root / 'teacher' / 'final'}",
              f"output_dir={root / 'stage1'}", "train.max_steps=1")
    return root


@pytest.mark.parametrize("resume", ["resume=none", "resume=latest"])
def test_linearize_into_its_own_teachers_folder_is_refused(teacher_run, resume):
    """The issue's first repro: stage 1 with output_dir = the teacher's run folder replaced its final/."""
    teacher = teacher_run / "teacher"
    refused(lambda t: linearize("--config", TINY_DIT, f"model.init_from={t / 'final'}", f"output_dir={t}",
                                "train.max_steps=1", resume),
            teacher, match=r"output_dir=.* contains model.init_from=")


def test_train_and_finetune_refuse_an_output_dir_holding_their_start_point(teacher_run, tmp_path):
    teacher = teacher_run / "teacher"
    refused(lambda t: train_dit(f"model.init_from={t / 'final'}", f"output_dir={t}", "resume=none",
                                "train.max_steps=1"), teacher, match="contains model.init_from")
    refused(lambda t: train_dit(f"model.init_from={t / 'final'}", f"output_dir={t / 'final'}",
                                "train.max_steps=1"), teacher, match="is model.init_from")
    link = tmp_path / "link"  # a symlink to the teacher's run folder: compared as the real path
    link.symlink_to(teacher)
    refused(lambda t: train_dit(f"model.init_from={teacher / 'final'}", f"output_dir={link}",
                                "resume=none", "train.max_steps=1"), teacher, match="contains model.init")


def test_finetune_sana_refuses_an_output_dir_holding_model_transformer(tmp_path):
    from mhla_gen.testing import tiny_sana_pipeline

    tiny_sana_pipeline().save_pretrained(tmp_path / "ckpt")
    run = tmp_path / "s"
    (run / "final").mkdir(parents=True)
    write_marker(run, "run")
    pipe_transformer = tmp_path / "ckpt" / "transformer"
    for name in os.listdir(pipe_transformer):
        (run / "final" / name).write_bytes((pipe_transformer / name).read_bytes())
    write_marker(run / "final", "model")
    (tmp_path / "data").mkdir()  # one readable item: the data pass their own start-up checks
    Image.new("RGB", (32, 32)).save(tmp_path / "data" / "0.png")
    (tmp_path / "data" / "0.txt").write_text("a cat")
    args = ("--config", TINY_SANA, f"model.pretrained={tmp_path / 'ckpt'}", f"data.path={tmp_path / 'data'}")
    refused(lambda t: run_inprocess("finetune_sana.py", *args, f"model.init_from={t / 'final'}",
                                    f"output_dir={t}", "resume=none"),
            run, match="contains model.init_from")


def test_generate_into_the_run_it_samples_is_refused(teacher_run):
    """generate with output_dir = the training run (or its final/) would replace the run's config.yaml."""
    run = teacher_run / "teacher"
    generate = load_script("eval/generate.py").main
    for target in (run, run / "final"):
        refused(lambda t: generate(["base=dit", f"run_config={run / 'config.yaml'}", "labels=[0]", "steps=1",
                                    f"output_dir={t}"]), target, run, match=r"output_dir=.* (contains|is) ")


def test_the_finished_run_hint_does_not_suggest_losing_it(teacher_run, tmp_path):
    """resume=latest on a finished run without checkpoints: the hint must not say resume=none."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(teacher_run / "teacher", run)
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(ConfigError, match="holds a finished run") as info:
        train_dit(f"output_dir={run}", "train.max_steps=2")
    assert "resume=none" not in str(info.value)


# ------------------------------------------------------------------------- 2. delete only what you listed
def _captioned(out: Path, seed: int, count: int = 3) -> None:
    from mhla_gen.data.teacher import write_teacher_captioned

    sample = lambda prompt, i: Image.new("RGB", (4, 4), (seed, i, 0))  # noqa: E731
    write_teacher_captioned(sample, lambda image, path: image.save(path), out, ["a cat"], count, ".png",
                            {"seed": seed})


def test_teacher_data_rebuild_deletes_only_its_listed_files(tmp_path):
    """Re-sampling with other settings deleted every [0-9]* entry, the user's included."""
    out = tmp_path / "teacher_data"
    _captioned(out, 1)
    assert set(listed(out)) >= {"000000.png", "000000.txt", "meta.json"}
    _captioned(out, 2, count=2)  # other settings: the listed files go, the new ones come
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".png")) == ["000000.png", "000001.png"]
    assert Image.open(out / "000000.png").getpixel((0, 0))[0] == 2
    mine = user_files(out, ["1_my_photo.png", "2024_notes.txt"])
    refused(lambda t: _captioned(t, 3), mine, match=r"also holds files it did not write \(1_my_photo.png")


def test_dit_teacher_data_rebuild_keeps_the_users_files(tmp_path):
    from mhla_gen.data.teacher import write_teacher_samples

    out = tmp_path / "teacher_data"
    generate = lambda labels, k: torch.full((len(labels), 1, 2, 2), float(k))  # noqa: E731
    write_teacher_samples(generate, out, [0, 1, 0], {"v": 1}, {}, chunk=2)
    assert {"latents.npy", "labels.npy", "meta.json"} <= set(listed(out))
    user_files(out, ["2024_notes.txt"])
    refused(lambda t: write_teacher_samples(generate, t, [0, 1], {"v": 2}, {}, chunk=2), out,
            match=r"2024_notes.txt")
    (out / "2024_notes.txt").unlink()
    write_teacher_samples(generate, out, [0, 1], {"v": 2}, {}, chunk=2)
    assert np.load(out / "labels.npy").tolist() == [0, 1] and not (out / "parts").exists()


def test_a_cache_whose_listed_file_changed_is_not_replaced(assets, tmp_path):  # noqa: F811
    from test_ownership import write

    target = tmp_path / "out"
    write("extract_latents", assets, target)
    with open(target / "meta.json", "a") as f:
        f.write(" ")  # same name, other bytes: no longer what we wrote
    refused(lambda t: write("extract_latents", assets, t), target, match=r"meta\.json")


def test_a_symlinked_or_unmarked_final_is_refused_at_start_up(teacher_run, tmp_path):
    """An unmarked final/ is foreign (no vouching by names); a symlink is refused before training."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(teacher_run / "teacher", run)
    shutil.rmtree(run / "final")
    user_files(run / "final", ["config.json", "diffusion_pytorch_model-00001-of-00002.safetensors",
                               "diffusion_pytorch_model.safetensors.index.json"])
    refused(lambda t: train_dit(f"output_dir={t}", "train.max_steps=2", "model.attention=softmax"), run,
            match=r"final/\)=.* not written by mhla_gen")
    shutil.rmtree(run / "final")
    (run / "final").symlink_to(teacher_run / "teacher" / "final")
    refused(lambda t: train_dit(f"output_dir={t}", "train.max_steps=2", "model.attention=softmax"), run,
            teacher_run / "teacher", match="is a symbolic link")


def _checkpointed(run: Path, steps: int, *extra: str) -> None:
    train_dit(f"output_dir={run}", f"train.max_steps={steps}", "train.checkpoint_every=1",
              "train.checkpoints_total_limit=1", "log.sample_every=0", *extra)


def test_old_checkpoints_are_pruned_only_when_they_hold_what_they_list(tmp_path, caplog):
    """checkpoints_total_limit deleted old checkpoint_<N> folders by name: a user's file inside one, or a
    checkpoint of an earlier version (no listing), went with it. Now they stay, each with a warning (the
    earlier version's with the adopt command), and are pruned once adopted / emptied of the user's file."""
    import json
    import shutil

    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    _checkpointed(run, 2)
    assert [p.name for p in ckpts.iterdir()] == ["checkpoint_2"]  # checkpoint_1: ours, listed, pruned
    assert read_marker(ckpts / "checkpoint_2")["kind"] == "checkpoint"
    assert "trainer_state.json" in listed(ckpts / "checkpoint_2")
    user_files(ckpts / "checkpoint_2", ["my_notes.txt"])
    old = ckpts / "checkpoint_1"  # as an mhla_gen without markers wrote it
    shutil.copytree(ckpts / "checkpoint_2", old, ignore=shutil.ignore_patterns(MARKER, "my_notes.txt"))
    state = json.loads((old / "trainer_state.json").read_text())
    (old / "trainer_state.json").write_text(json.dumps({**state, "step": 1}))
    before = checksums(ckpts / "checkpoint_2", old)
    _checkpointed(run, 3)
    assert checksums(ckpts / "checkpoint_2", old) == before
    assert f"mhla-gen adopt checkpoint {old}" in caplog.text
    assert "(my_notes.txt); left untouched" in caplog.text
    adopt("run", run)  # lists checkpoint_1's files: the next save prunes it
    (ckpts / "checkpoint_2" / "my_notes.txt").unlink()
    _checkpointed(run, 4)
    assert sorted(p.name for p in ckpts.iterdir()) == ["checkpoint_4"]


def test_a_torn_checkpoint_save_is_kept_unless_it_holds_only_what_it_lists(tmp_path, caplog):
    """A save killed inside accelerator.save_state leaves a marked temp folder whose files are not listed
    yet: it stays (warning), and the resumed run saves that step into a temp folder of its own."""
    from mhla_gen.outputs.folders import record_files

    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    _checkpointed(run, 2)
    torn = user_files(ckpts / ".tmp-checkpoint_3", ["model.safetensors"])
    write_marker(torn, "checkpoint", temporary=True)
    listed_torn = user_files(ckpts / ".tmp-checkpoint_9", ["model.safetensors"])
    write_marker(listed_torn, "checkpoint", temporary=True)
    record_files(listed_torn, "model.safetensors")
    user = user_files(ckpts / ".tmp-checkpoint_4", ["notes.txt"])  # not ours (no marker): never touched
    before = checksums(torn, user)
    _checkpointed(run, 4)
    assert checksums(torn, user) == before and not listed_torn.exists()
    assert f"{torn} holds entries its list of files does not name (model.safetensors)" in caplog.text
    left = sorted(p.name for p in ckpts.iterdir())
    assert left == [".tmp-checkpoint_3", ".tmp-checkpoint_4", "checkpoint_4"]


# ------------------------------------------------------------------------------ 3. adopt proves content
def adopt(*args):
    from mhla_gen.commands.adopt import main

    main(list(map(str, args)))


def test_adopt_samples_refuses_a_users_reference_images(assets, tmp_path):  # noqa: F811
    """The issue's repro: reference PNGs + config.yaml were accepted, then generate overwrote config.yaml."""
    import shutil

    mine = tmp_path / "refs"
    shutil.copytree(assets / "samples", mine)
    user_files(mine, ["config.yaml"])
    refused(lambda t: adopt("samples", t), mine, match=r"manifest.jsonl: missing")


def _sample_file(path: Path) -> Path:
    """A PNG, or the head of an MP4 (what adopt reads of a video: its ``ftyp`` box)."""
    if path.suffix == ".mp4":
        path.write_bytes(b"\x00\x00\x00\x18ftypisom" + bytes(16))
    else:
        from PIL import Image

        Image.new("RGB", (4, 4)).save(path)
    return path


@pytest.mark.parametrize("name", sorted(BASES))
def test_adopt_accepts_the_sample_sets_and_sample_outputs_of_every_base(name, tmp_path):
    """Regression: adopt knew base names as a tuple (dit, sana, wan) and refused every SANA-Video and Wan
    I2V sample set (and their scripts/sample.py videos); it now asks the records, for model folders too."""
    base = BASES[name]
    samples = tmp_path / "samples"
    samples.mkdir()
    _sample_file(samples / f"000000{base.sample_suffix}")
    record = {"index": 0, "file": f"000000{base.sample_suffix}"}
    (samples / "manifest.jsonl").write_text(json.dumps(record) + "\n")
    (samples / "config.yaml").write_text(f"base: {name}\n")
    adopt("samples", samples)
    assert read_marker(samples)["kind"] == "samples"

    outputs = tmp_path / "outputs"
    outputs.mkdir()
    images = [f"{name}_seed0_00_a_cat.png", f"{name}_seed0_grid.png"]
    for file in [f"{name}_seed0_00.mp4"] if base.video else images:
        _sample_file(outputs / file)
    adopt("sample_outputs", outputs)
    assert read_marker(outputs)["kind"] == "sample_outputs"

    from mhla_gen import install_mhla

    tiny = base.tiny.load()  # a model folder of the record's transformer class (config.json names it)
    install_mhla(tiny.model(), tiny.mhla).save_pretrained(tmp_path / "model")
    adopt("model", tmp_path / "model")
    assert read_marker(tmp_path / "model")["kind"] == "model"


def test_adopt_refuses_a_sample_set_of_an_unknown_base(tmp_path):
    _sample_file(tmp_path / "000000.png")
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"index": 0, "file": "000000.png"}) + "\n")
    (tmp_path / "config.yaml").write_text("base: unet\n")
    refused(lambda t: adopt("samples", t), tmp_path, match=r"config.yaml: not an eval/generate.py config")
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    _sample_file(outputs / "unet_seed0_00.mp4")
    refused(lambda t: adopt("sample_outputs", t), outputs, match=r"unet_seed0_00.mp4: not a file scripts/")


def test_adopt_study_and_model_refuse_what_mhla_gen_did_not_write(tmp_path):
    from mhla_gen.testing import tiny_dit_pipeline

    refused(lambda t: adopt("study", t), user_files(tmp_path / "mine", ["notes.txt"]),
            match=r"notes.txt: not an entry of a study")
    stock = tmp_path / "saved"
    tiny_dit_pipeline().transformer.save_pretrained(stock)  # a user's save_pretrained: no mhla record
    refused(lambda t: adopt("model", t), stock, match=r"config.json: has no mhla record")


def test_adopt_accepts_our_own_folders_and_lists_their_files(teacher_run, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(teacher_run / "stage1" / "final", model)
    for name in (MARKER, LISTING):
        (model / name).unlink(missing_ok=True)
    edited = tmp_path / "edited"  # AutoModel's module file, changed by hand: not what mhla_gen wrote
    shutil.copytree(model, edited)
    (edited / "mhla_gen_auto_model.py").write_text("import os\n")
    refused(lambda t: adopt("model", t), edited, match=r"mhla_gen_auto_model.py: not the module file")
    adopt("model", model)
    assert "claiming as a transformer folder" in capsys.readouterr().out
    assert read_marker(model)["kind"] == "model" and "mhla_gen_auto_model.py" in listed(model)
    run = tmp_path / "run"
    shutil.copytree(teacher_run / "teacher", run)
    for path in run.rglob(MARKER):
        path.unlink()
    adopt("run", run)
    assert read_marker(run / "final")["kind"] == "model"


def test_every_refusal_of_an_earlier_versions_folder_prints_the_adopt_command(tmp_path, caplog):
    """A folder an earlier version marked without listing its files (or did not mark at all) is never
    replaced or deleted; every refusal and warning prints the command that lists it, exactly."""
    from mhla_gen.data.teacher import check_teacher_folder
    from mhla_gen.outputs.folders import check_replaceable, discard
    from mhla_gen.train import checkpoint

    checks = {
        "model": lambda f: check_replaceable(f, "model", "--out"),
        "latent_cache": lambda f: check_replaceable(f, "latent_cache", "--out"),
        "feature_cache": lambda f: check_replaceable(f, "feature_cache", "data.cache_dir"),
        "teacher_data": lambda f: check_teacher_folder(f),
        "checkpoint": checkpoint._check_replaceable,
    }
    for kind, check in checks.items():
        for marked in (True, False):
            folder = user_files(tmp_path / f"{kind}_{marked}", ["000000.png", "weights.bin"])
            if marked:
                write_marker(folder, kind)
            refused(check, folder, match=rf"mhla-gen adopt {kind} {folder}$")
            before = checksums(folder)
            assert not discard(folder, kind, "output_dir") and checksums(folder) == before
            assert f"mhla-gen adopt {kind} {folder}" in caplog.text


# ------------------------------------------------------------------------------ 4. recorded teacher
def test_stage1_records_the_teacher_resolved_with_a_fingerprint(teacher_run):
    marker = read_marker(teacher_run / "stage1" / "final")
    assert marker["teacher"] == str((teacher_run / "teacher" / "final").resolve())
    assert marker["teacher_record"]["path"] == marker["teacher"] and marker["teacher_record"]["sha256"]


def test_config_yaml_names_the_inputs_resolved(teacher_run, tmp_path, monkeypatch):
    """A relative ``model.init_from`` is written to ``config.yaml`` resolved and absolute (and so is the
    distillation teacher stage 2 derives from it): the file says which model was used wherever it is read."""
    import yaml

    monkeypatch.chdir(teacher_run)
    linearize("--config", TINY_DIT, "model.init_from=teacher/final", f"output_dir={tmp_path / 's1'}",
              "train.max_steps=1")
    written = yaml.safe_load((tmp_path / "s1" / "config.yaml").read_text())
    assert written["model"]["init_from"] == str((teacher_run / "teacher" / "final").resolve())
    _stage2(tmp_path / "s1", tmp_path / "s2")
    written = yaml.safe_load((tmp_path / "s2" / "config.yaml").read_text())
    assert written["train"]["distill"]["teacher"] == str((teacher_run / "teacher" / "final").resolve())
    assert written["model"]["init_from"] == str((tmp_path / "s1" / "final").resolve())


def _stage2(stage1: Path, out: Path, *extra: str):
    train_dit(f"model.init_from={stage1 / 'final'}", "model.attention=mhla", f"output_dir={out}",
              "train.max_steps=1", "train.distill.output_weight=1", *extra)


def test_stage2_refuses_a_moved_changed_or_mhla_teacher(teacher_run, tmp_path, monkeypatch):
    import shutil

    root = tmp_path / "root"
    shutil.copytree(teacher_run, root)
    stage1 = root / "stage1"
    record = read_marker(stage1 / "final")
    record["teacher"] = str(root / "teacher" / "final")
    record["teacher_record"]["path"] = record["teacher"]
    write_marker(stage1 / "final", "model", **{k: v for k, v in record.items() if k not in ("kind", "note")})
    monkeypatch.chdir(tmp_path)  # run from another folder: the record is absolute
    _stage2(stage1, tmp_path / "ok")  # config.yaml says which teacher was used, resolved
    assert f"teacher: {record['teacher']}" in (tmp_path / "ok" / "config.yaml").read_text()

    weights = next((root / "teacher" / "final").glob("*.safetensors"))
    original = weights.read_bytes()
    weights.write_bytes(original[:-4] + bytes(b ^ 0xFF for b in original[-4:]))  # retrained: same size
    with pytest.raises(ConfigError, match="has changed since it was recorded.*train.distill.teacher=PATH"):
        _stage2(stage1, tmp_path / "changed")
    weights.write_bytes(original)
    (root / "teacher" / "final").rename(root / "moved")
    with pytest.raises(ConfigError, match="no longer exists"):
        _stage2(stage1, tmp_path / "moved")
    shutil.copytree(stage1 / "final", root / "teacher" / "final")  # the path now holds an MHLA model
    with pytest.raises(ConfigError, match="has changed|runs MHLA"):
        _stage2(stage1, tmp_path / "mhla")
    _stage2(stage1, tmp_path / "named", f"train.distill.teacher={root / 'moved'}")  # named: used
    assert not (tmp_path / "changed").exists() and not (tmp_path / "moved").exists()


def test_a_teacher_recorded_as_typed_by_an_earlier_version_is_refused(teacher_run, tmp_path):
    import shutil

    stage1 = tmp_path / "stage1"
    shutil.copytree(teacher_run / "stage1", stage1)
    write_marker(stage1 / "final", "model", teacher="runs/t/final", num_classes=10)
    with pytest.raises(ConfigError, match="recorded without its resolved path"):
        _stage2(stage1, tmp_path / "out")


# ---------------------------------------------------------------------------- 5. one writer per folder
HOLD = """
import fcntl, os, sys, time
folder = sys.argv[1]
os.makedirs(folder, exist_ok=True)
fd = os.open(os.path.join(folder, ".mhla_gen.lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_writer_stops_naming_the_holder(teacher_run, tmp_path, capsys, monkeypatch):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(teacher_run / "teacher", run)
    holder = subprocess.Popen([PYTHON, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = fails_in_one_line("scripts/train_dit.py", ["--config", TINY_DIT, f"output_dir={run}",
                                 "train.max_steps=2", "model.attention=softmax"], capsys, monkeypatch)
        assert f"being written by another command (pid {holder.pid})" in line
    finally:
        holder.kill()
        holder.wait()
    assert not (run / "checkpoints" / "checkpoint_2").exists()


def test_a_stale_lock_record_is_cleared_with_a_message(tmp_path, caplog):
    from mhla_gen.outputs.folders import claim
    from mhla_gen.outputs.locks import LOCK, release

    dead = subprocess.Popen([PYTHON, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "samples"
    claim(folder, "sample_outputs", "--out")
    release(folder)
    (folder / LOCK).write_text(f"{dead.pid}\n")
    claim(folder, "sample_outputs", "--out")
    release(folder)
    assert f"cleared a stale lock record of pid {dead.pid}" in caplog.text


HOLD_FILE = """
import fcntl, os, sys, time
folder, name = os.path.split(sys.argv[1])
fd = os.open(os.path.join(folder, f".{name}.mhla_gen.lock"), os.O_RDWR | os.O_CREAT)  # as locks.lock_file
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(60)
"""


def _single_file_writers(tmp_path: Path) -> dict:
    """Each writer of one output file -> a call of it writing ``tmp_path / 'out.*'`` (checks pass)."""
    (tmp_path / "videos").mkdir()
    (tmp_path / "samples").mkdir()
    wan_step = ["--tiny", "--device", "cpu", "--frames", "1", "--height", "16", "--width", "16",
                "--reps", "1", "--warmup", "0"]
    return {
        "eval/fid.py": lambda out: load_script("eval/fid.py").main(
            ["--samples", str(tmp_path / "samples"), "--ref", "digits", "--out", str(out)]),
        "eval/vbench.py": lambda out: load_script("eval/vbench.py").main(
            ["--videos", str(tmp_path / "videos"), "--out", str(out)]),
        "benchmarks/bench_attention.py": lambda out: load_script("benchmarks/bench_attention.py").main(
            ["--sizes", "--device", "cpu", "--out", str(out)]),
        "benchmarks/bench_wan_step.py": lambda out: load_script("benchmarks/bench_wan_step.py").main(
            [*wan_step, "--out", str(out)]),
        "scripts/gpu_check.py": lambda out: load_script("scripts/gpu_check.py").main(
            ["--out", str(out)], probe=lambda: {}, runner=lambda section: pytest.fail("ran")),
    }


@pytest.mark.parametrize("writer", ["eval/fid.py", "eval/vbench.py", "benchmarks/bench_attention.py",
                                    "benchmarks/bench_wan_step.py", "scripts/gpu_check.py"])
def test_a_second_writer_of_one_output_file_stops_naming_the_holder(writer, tmp_path):
    """Single output files (metrics JSON, benchmark reports) are locked too: the second writer stops at
    start-up, before any work, naming the first one's pid; nothing of the held file's is touched."""
    out = tmp_path / "out.json"
    holder = subprocess.Popen([PYTHON, "-c", HOLD_FILE, str(out)], stdout=subprocess.PIPE, text=True,
                              env=subprocess_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        write = _single_file_writers(tmp_path)[writer]
        before = checksums(tmp_path)
        busy = rf"--out=.*being written by another command \(pid {holder.pid}\)"
        with pytest.raises(ConfigError, match=busy):
            write(out)
        assert checksums(tmp_path) == before and not out.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_single_file_lock_is_removed_on_release_and_a_stale_one_cleared(tmp_path, caplog):
    from mhla_gen.outputs.locks import file_lock_path, lock_file, release_file, writing_files

    out = tmp_path / "report.json"
    load_script("benchmarks/bench_attention.py").main(["--sizes", "--device", "cpu", "--out", str(out)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # the lock file went with the lock
    dead = subprocess.Popen([PYTHON, "-c", "pass"])
    dead.wait()
    file_lock_path(out).write_text(f"{dead.pid}\n")  # left by a writer that was killed
    with writing_files((out, "--out")):
        assert file_lock_path(out).read_text() == f"{os.getpid()}\n"
    assert f"cleared a stale lock record of pid {dead.pid}" in caplog.text
    assert not file_lock_path(out).exists()
    mine = user_files(tmp_path, [file_lock_path(out).name])  # a user's file of that name: never written
    before = checksums(mine)
    with pytest.raises(ConfigError, match="is not a lock record of mhla_gen"):
        lock_file(out, "--out")
    release_file(out)
    assert checksums(mine) == before


PARENT = """
import subprocess, sys, time
code = ("import os, time; from mhla_gen.outputs.locks import die_with_parent; die_with_parent(os.getppid()); "
        "print('ready', flush=True); time.sleep(60)")
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_workers_die_with_their_parent(tmp_path):
    """SIGKILL of a study's process: its workers (which call die_with_parent) stop too."""
    parent = subprocess.Popen([PYTHON, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=subprocess_env())
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the worker outlived its parent")


LOCKS_ALONE = """
import sys, types
package = types.ModuleType("mhla_gen")  # outputs.locks without the package's imports (diffusers: 10 s)
package.__path__ = [sys.argv[1]]
sys.modules["mhla_gen"] = package
from mhla_gen.outputs.locks import die_with_launcher, dying_with_us
"""
RANK = LOCKS_ALONE + """
import os, time
import torch.distributed as dist
die_with_launcher()  # as the ranks of eval/generate.py and of the training scripts do
dist.init_process_group("gloo")
os.write(1, f"rank {os.getpid()} of {dist.get_world_size()}\\n".encode())  # one write: lines never interleave
time.sleep(60)
"""
LAUNCHING_PARENT = LOCKS_ALONE + """
import subprocess
launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", sys.argv[2], sys.argv[1]], preexec_fn=dying_with_us())
print(f"launcher {launcher.pid}", flush=True)
launcher.wait()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
@pytest.mark.parametrize("killed", ["parent", "launcher"])
def test_the_ranks_of_a_real_launch_die_with_their_parent(killed, tmp_path):
    """A process of ours starts a real torchrun with two gloo ranks (world size asserted inside them);
    SIGKILL of that process (or of the launcher itself) leaves no launcher and no rank running."""
    import queue
    import threading

    rank = tmp_path / "rank.py"
    rank.write_text(RANK)
    env = subprocess_env()
    parent = subprocess.Popen([PYTHON, "-c", LAUNCHING_PARENT, str(REPO / "mhla_gen"), str(rank)],
                              stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in parent.stdout], daemon=True).start()
    pids = {}
    try:
        while len(pids) < 3:  # the launcher, then its two ranks
            words = lines.get(timeout=60).split()
            pids[int(words[1])] = words[0]
            assert words[0] == "launcher" or words[3] == "2", f"world size {words[3]} inside a rank"
        victim = parent.pid if killed == "parent" else next(p for p, w in pids.items() if w == "launcher")
        os.kill(victim, signal.SIGKILL)
        if killed == "parent":
            parent.wait()
        deadline = time.monotonic() + 15
        while any(map(running, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [f"{what} {pid}" for pid, what in pids.items() if running(pid)]
        assert not left, f"outlived the kill: {left}"
    finally:
        for pid in [*pids, parent.pid]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


# ------------------------------------------------------------------------------------- 6. smaller cases
@pytest.mark.parametrize("value", ["[1.5]", "1", "true"])
def test_hybrid_softmax_layers_is_type_checked(value, tmp_path, capsys, monkeypatch, teacher_run):
    out = tmp_path / "s1"
    line = fails_in_one_line("scripts/linearize.py", ["--config", TINY_DIT,
                             f"model.init_from={teacher_run / 'teacher' / 'final'}", f"output_dir={out}",
                             f"hybrid.softmax_layers={value}"], capsys, monkeypatch)
    assert "hybrid.softmax_layers must be null, auto:K or a list of layer indices (integers)" in line
    assert not out.exists()


def test_adaptation_arms_are_checked_before_training(tmp_path, capsys, monkeypatch):
    import mhla_gen.train.loop

    monkeypatch.setattr(mhla_gen.train.loop, "train", lambda *a, **k: pytest.fail("trained"))
    line = fails_in_one_line("eval/adaptation.py", ["--quick", "--arms", "bogus", "--out",
                             str(tmp_path / "a")], capsys, monkeypatch)
    assert "--arms bogus: no such arm" in line and not (tmp_path / "a").exists()


def test_class_folders_without_a_readable_image_stop_at_start_up(tmp_path, capsys, monkeypatch):
    for c in ("a", "b"):
        (tmp_path / "data" / c).mkdir(parents=True)
        (tmp_path / "data" / c / "0.png").write_bytes(b"not a png")
    line = fails_in_one_line("scripts/train_dit.py", ["--config", TINY_DIT, "data.source=folder",
                             f"data.path={tmp_path / 'data'}", "model.num_classes=2", "data.vae=null",
                             f"output_dir={tmp_path / 'run'}"], capsys, monkeypatch)
    assert "none of its 2 image files can be read" in line and not (tmp_path / "run").exists()


def test_generate_checks_the_model_before_writing(tmp_path, capsys, monkeypatch):
    line = fails_in_one_line("eval/generate.py", ["base=dit", f"model={tmp_path / 'missing'}", "labels=[0]",
                             f"output_dir={tmp_path / 'gen'}"], capsys, monkeypatch)
    assert "is not a diffusers pipeline folder" in line and not (tmp_path / "gen").exists()


def test_extract_latents_resolution_must_fit_the_vae(assets, tmp_path, capsys, monkeypatch):  # noqa: F811
    line = fails_in_one_line("scripts/extract_latents.py", ["--data", str(assets / "classes"), "--out",
                             str(tmp_path / "c"), "--vae", str(assets / "vae"), "--resolution", "15",
                             "--device", "cpu"], capsys, monkeypatch)
    assert "--resolution 15 is not a multiple of the VAE's downsampling factor 2" in line
    assert not (tmp_path / "c").exists()


def test_bench_out_with_a_tilde_is_written_where_it_was_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    load_script("benchmarks/bench_attention.py").main(["--sizes", "--device", "cpu", "--out", "~/x.json"])
    assert (tmp_path / "x.json").is_file() and not (tmp_path / "~").exists()


# --------------------------------------------------------------- 8. every entry point, writer and input
ENTRY_POINTS = {  # script -> how it keeps outputs apart from inputs, and locks/marks what it writes
    "scripts/train_dit.py": "train", "scripts/finetune_sana.py": "train", "scripts/finetune_wan.py": "train",
    "scripts/finetune_sana_video.py": "train", "scripts/finetune_wan_i2v.py": "train",
    "scripts/linearize.py": "train", "scripts/sample.py": "check_apart", "scripts/extract_latents.py":
    "check_cache_target", "scripts/convert_wan_mhla.py": "check_apart", "scripts/diffusers_model_tests.py":
    "check_apart", "eval/generate.py": "check_apart", "eval/attention_stats.py": "check_apart",
    "eval/adaptation.py": "check_apart", "eval/study.py": "study_records", "eval/fid.py": "check_apart",
    "eval/scale_study.py": "run_jobs",  # its --out through claim; --export: its own two files only
    "eval/vbench.py": "check_apart", "benchmarks/bench_attention.py": "check_file_target",
    "eval/results.py": "check_render_target",  # render: a new or empty --out; regenerate: its listed files
    "benchmarks/bench_wan_step.py": "check_file_target", "benchmarks/bench_models.py": None,
    "benchmarks/conversion_budget.py": None, "benchmarks/profile_mhla.py": None,  # print only
    "benchmarks/bench_rope.py": None, "benchmarks/tune_mhla_tiles.py": "check_file_target",
    "benchmarks/kernel_resources.py": None,  # print only
    "scripts/gpu_check.py": "check_report_target",  # one report file: new, its own, or --overwrite
    "benchmarks/bench_dit_step.py": None, "benchmarks/bench_sana_step.py": None,  # print only
    "benchmarks/bench_host_overhead.py": None, "benchmarks/step_timing.py": None,
    "eval/stream_study.py": "claim", "eval/stream_bed.py": None,  # the bed and the tables: helpers of
    "eval/stream_report.py": None,  # eval/stream_study.py, which writes (its --out, claimed)
}
# The only places that delete files, each deleting what its own listing / marker names
DELETERS = {
    "mhla_gen/outputs/folders.py":
        "remove_listed, replace_with, discard (a marked folder holding what it lists)",
    "mhla_gen/data/teacher.py": "its own parts/ files by name once assembled",
    "mhla_gen/commands/generate.py": "the manifest shards it listed",
    "mhla_gen/outputs/locks.py":
        "the .<name>.mhla_gen.lock file it created (or a pid record of a killed writer)",
    "eval/results.py": "add: the records/<name>/ folder it made in the same call, when rendering fails",
}
PATH_FIELDS = ("init_from", "transformer", "pretrained", "path", "vae", "teacher", "prompts_file",
               "cache_dir")


def entry_source(script: str) -> str:
    """The script's source; for a thin script, also the command it runs (``mhla_gen/commands/<name>.py``)."""
    source = (REPO / script).read_text()
    for module in re.findall(r"^from (mhla_gen\.commands\.\w+) import main$", source, flags=re.M):
        source += (REPO / f"{module.replace('.', '/')}.py").read_text()
    return source


def test_every_entry_point_checks_apart_and_every_deleter_is_known():
    """A new script must say how it keeps inputs apart (and its writes go through claim / fresh_temp,
    which mark and lock); a new deletion site must be reviewed against the listing rule."""
    folders = ("scripts", "eval", "benchmarks")
    scripts = {str(p.relative_to(REPO)) for d in folders for p in (REPO / d).glob("*.py")}
    assert scripts == set(ENTRY_POINTS), "classify every entry point in ENTRY_POINTS"
    for script, how in ENTRY_POINTS.items():
        source = entry_source(script)
        assert how is None or how in source or "train_main" in source or "linearize_main" in source, script
        if "claim(" in source or "fresh_temp(" in source or "os.replace(" in source:
            assert how is not None, f"{script} writes a folder without an apart check"
    for path in [*REPO.glob("mhla_gen/**/*.py"), *(p for d in folders for p in REPO.glob(f"{d}/**/*.py"))]:
        source = path.read_text()
        deletes = any(call in source for call in ("rmtree(", ".unlink(", "os.remove(", ".rmdir("))
        rel = str(path.relative_to(REPO))
        assert not deletes or rel in DELETERS, f"{rel} deletes files: list by name (mhla_gen.outputs.folders)"
        assert "fnmatch" not in source, f"{rel}: no deletion or ownership by pattern"


@pytest.mark.parametrize("base", [*sorted(BASES), "linearize"])
def test_every_input_setting_is_checked_apart_and_recorded(base):
    """Every path-like setting of every run config is an input the task reports (TrainTask.inputs):
    the loop checks output_dir against it and records it resolved in the run's marker."""
    import dataclasses

    from mhla_gen.bases import base_for
    from mhla_gen.train.linearize import TransferTask, stage1_schema

    record = base_for("dit" if base == "linearize" else base)
    schema = stage1_schema(record) if base == "linearize" else record.run_config.load()
    task_cls = record.task.load()
    cfg = schema()
    settings = []
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            names = [f.name for f in dataclasses.fields(value)]
            settings += [f"{section.name}.{name}" for name in names if name in PATH_FIELDS
                         and f"{section.name}.{name}" != "model.transformer"]  # an alias, read as init_from
            settings += [f"{section.name}.distill.teacher" for f in dataclasses.fields(value)
                         if f.name == "distill"]
    for setting in settings:
        parts = setting.split(".")
        target = cfg
        for part in parts[:-1]:
            target = getattr(target, part)
        setattr(target, parts[-1], f"/nonexistent/{setting}")
    cfg.data.source = "latents" if record.class_conditional else "teacher"
    if hasattr(cfg.train.distill, "output_weight"):
        cfg.train.distill.output_weight = 1.0
    build = lambda: TransferTask(cfg, task_cls(cfg)) if base == "linearize" else task_cls(cfg)
    reported = build().inputs()
    if record.class_conditional:  # DiT reads data.teacher with data.source=teacher (its source)
        cfg.data.source = "teacher"
        reported = {**reported, **build().inputs()}
    missing = [s for s in settings if s not in reported]
    assert not missing, f"settings the apart check does not cover: {missing}"


def test_a_folder_lock_released_or_left_at_exit_leaves_no_stale_record(tmp_path, caplog):
    """Only a killed holder leaves its pid in a folder's lock: after a release, or a normal exit without
    one, the next holder takes the folder without a stale-record message (every rerun printed one)."""
    from mhla_gen.outputs.folders import claim
    from mhla_gen.outputs.locks import LOCK, release

    folder = tmp_path / "samples"
    claim(folder, "sample_outputs", "--out")
    release(folder)
    assert (folder / LOCK).read_text() == ""
    exits = ("import sys; from mhla_gen.outputs.locks import lock_folder; lock_folder(sys.argv[1], '--out')")
    subprocess.run([PYTHON, "-c", exits, str(folder)], check=True)
    assert (folder / LOCK).read_text() == ""
    claim(folder, "sample_outputs", "--out")
    release(folder)
    assert "stale lock record" not in caplog.text
