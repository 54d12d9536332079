"""Nothing lost: every command that writes, against folders and files that are not its own.

The matrix of ``outputs.folders``' rule: each writer x {an empty folder, a user's files with names the
project uses, a marked folder of another kind, our own earlier output, a leftover temporary folder of
ours, a user's ``.tmp-<name>`` sibling, a sharded model folder, an existing reference ``.npz``}. User
bytes are compared by checksum before and after; our own outputs must be reusable.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import save_file
from script_helpers import load_script
from train_helpers import REPO, run_inprocess

from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import MARKER, read_marker, write_marker

TINY_DIT = str(REPO / "mhla_gen" / "configs" / "tiny" / "dit.yaml")


def checksums(*roots: Path) -> dict[str, str]:
    """Every file and folder under ``roots``: path -> sha256 of its bytes (``dir`` for folders)."""
    found = {}
    for root in roots:
        paths = [root, *root.rglob("*")] if root.exists() else []
        for p in paths:
            found[str(p)] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def user_files(folder: Path, names: list[str]) -> Path:
    """A user's folder holding files with the given names (distinct bytes each)."""
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"the user's own {name}\n".encode())
    return folder


def _work_entry_points():
    """Where each writer's real work starts (model loading, encoding, training): a refusal must come
    before any of them."""
    import diffusers

    import mhla_gen.commands.attention_stats
    import mhla_gen.commands.convert_wan
    import mhla_gen.integration.convert_wan
    import mhla_gen.integration.loading
    import mhla_gen.pipelines.dit
    import mhla_gen.train.runs
    from mhla_gen.data.images import CaptionedImageFolder
    from mhla_gen.train.dit import DiTTask

    return [(DiTTask, "build_transformer"), (diffusers.AutoencoderKL, "from_pretrained"),
            (mhla_gen.integration.convert_wan, "convert_wan_checkpoint"), (mhla_gen.integration.loading,
            "load_transformer"), (mhla_gen.pipelines.dit, "load_dit_pipeline"), (CaptionedImageFolder,
            "load"),
            # the names the commands imported (the scripts re-export the commands' modules)
            (mhla_gen.commands.convert_wan, "convert_wan_checkpoint"),
            (mhla_gen.commands.attention_stats, "load_transformer"),
            (mhla_gen.train.runs, "load_transformer")]


def _no_work(*args, **kwargs):
    raise AssertionError("work started before the output was checked")


def refused(write, target: Path, *watched: Path, match: str = "") -> None:
    """``write(target)`` raises ConfigError (naming ``match``) before any work, and leaves every byte
    under ``target`` and ``watched`` as it was."""
    before = checksums(target, *watched)
    with pytest.MonkeyPatch.context() as patch:
        for owner, name in _work_entry_points():
            patch.setattr(owner, name, _no_work)
        with pytest.raises(ConfigError, match=match):
            write(target)
    assert checksums(target, *watched) == before


# ------------------------------------------------------------------------------------------ assets
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Inputs every writer needs, built once: class folders, a tiny VAE, captioned images, a tiny DiT
    pipeline with MHLA, a released-Wan-style checkpoint, a DiT training run, a folder of samples."""
    from mhla_gen import MHLAConfig, install_mhla
    from mhla_gen.testing import tiny_autoencoder_kl, tiny_dit_pipeline

    root = tmp_path_factory.mktemp("assets")
    rng = np.random.default_rng(0)
    for c in range(2):
        for i in range(2):
            path = root / "classes" / f"class{c}" / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(path)
    tiny_autoencoder_kl().save_pretrained(root / "vae")
    (root / "captioned").mkdir()
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / "captioned" / f"{i}.png")
        (root / "captioned" / f"{i}.txt").write_text("a cat")
    pipe = tiny_dit_pipeline()
    install_mhla(pipe.transformer, MHLAConfig(blocks=(2, 2)))
    pipe.save_pretrained(root / "dit_pipe")
    _release_checkpoint(root)
    run_inprocess("train_dit.py", "--config", TINY_DIT, f"output_dir={root / 'run'}", "train.max_steps=1")
    digits = load_script("eval/fid.py").load_images("digits", 20).permute(0, 2, 3, 1).numpy()
    for i, img in enumerate(digits):
        (root / "samples").mkdir(exist_ok=True)
        Image.fromarray(img[..., 0]).save(root / "samples" / f"{i:06d}.png")
    return root


def _release_checkpoint(root: Path) -> None:
    from test_convert_wan import _original_state, _release_like_model

    model = _release_like_model()
    save_file(_original_state(model), root / "release.safetensors")
    (root / "wan_base" / "transformer").mkdir(parents=True)
    config = {k: v for k, v in model.config.items() if k != "mhla"} | {"_class_name": "WanTransformer3DModel"}
    (root / "wan_base" / "transformer" / "config.json").write_text(json.dumps(config))


# ----------------------------------------------------------------------------------------- writers
@dataclass(frozen=True)
class Writer:
    name: str
    kind: str  # the folder kind it writes (mhla_gen.outputs.folders.KINDS)
    user_names: tuple[str, ...]  # names it writes itself, planted as a user's files
    temp: bool = False  # builds in a .tmp-<name> sibling


WRITERS = {
    w.name: w
    for w in (
        Writer("train_dit", "run", ("config.yaml", "metrics.jsonl")),
        Writer("extract_latents", "latent_cache", ("labels.npy", "meta.json"), temp=True),
        Writer("feature_cache", "feature_cache", ("meta.json",), temp=True),
        Writer("convert_wan", "model", ("config.json", "diffusion_pytorch_model.safetensors"), temp=True),
        Writer("generate", "samples", ("000000.png", "config.yaml")),
        Writer("sample", "sample_outputs", ("dit_seed0_00_0.png", "dit_seed0_grid.png")),
        Writer("attention_stats", "attention_stats", ("attention_stats.json",)),
        Writer("study", "study", ("study.md",)),
    )
}


def write(name: str, assets: Path, target: Path, *extra: str) -> None:
    """Run writer ``name`` with ``target`` as its output folder."""
    if name == "train_dit":
        run_inprocess("train_dit.py", "--config", TINY_DIT, f"output_dir={target}", "train.max_steps=1",
                      *extra)
    elif name == "extract_latents":
        load_script("scripts/extract_latents.py").main(
            ["--data", str(assets / "classes"), "--out", str(target), "--vae", str(assets / "vae"),
             "--resolution", "16", "--device", "cpu"])
    elif name == "feature_cache":
        from mhla_gen.data import CaptionedImageFolder, build_feature_cache

        data = CaptionedImageFolder(assets / "captioned", 8, 8)
        encode = lambda item: {"latents": item["pixels"]}
        build_feature_cache(data, encode, target, {"v": 1}, "data.cache_dir")
    elif name == "convert_wan":
        load_script("scripts/convert_wan_mhla.py").main(
            ["--checkpoint", str(assets / "release.safetensors"), "--config-from", str(assets / "wan_base"),
             "--out", str(target)])
    elif name == "generate":
        load_script("eval/generate.py").main(
            ["base=dit", f"run_config={assets / 'run' / 'config.yaml'}", "labels=[0]", "steps=1",
             f"output_dir={target}", *extra])
    elif name == "sample":
        load_script("scripts/sample.py").main(
            ["--base", "dit", "--model", str(assets / "dit_pipe"), "--labels", "0", "--steps", "1",
             "--guidance", "1", "--device", "cpu", "--out", str(target), *extra])
    elif name == "attention_stats":
        load_script("eval/attention_stats.py").main(
            ["--model", str(assets / "run" / "final"), "--batch", "1", "--out-dir", str(target)])
    elif name == "study":
        load_script("eval/study.py").main(["--quick", "--seeds", "1", "--no-ablations", "--out", str(target)])
    else:
        raise AssertionError(name)


# ------------------------------------------------------------------------------------------ matrix
@pytest.mark.parametrize("name", WRITERS)
def test_a_users_files_with_project_names_are_never_touched(name, assets, tmp_path):
    """No name-based guessing: a folder holding only names the project writes is still the user's."""
    target = user_files(tmp_path / "out", list(WRITERS[name].user_names))
    refused(lambda t: write(name, assets, t), target, match=r"not empty and was not written by mhla_gen")


@pytest.mark.parametrize("name", WRITERS)
def test_a_marked_folder_of_another_kind_is_refused(name, assets, tmp_path):
    other = "latent_cache" if WRITERS[name].kind != "latent_cache" else "run"
    target = user_files(tmp_path / "out", ["meta.json"])
    write_marker(target, other)
    refused(lambda t: write(name, assets, t), target, match=f"is a {other} folder of mhla_gen")


@pytest.mark.parametrize("name", [n for n in WRITERS if n != "study"])  # study: slow, see test_eval_study
def test_an_empty_folder_is_used_and_our_own_output_is_reused(name, assets, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    write(name, assets, target)
    assert read_marker(target)["kind"] == WRITERS[name].kind
    again = {"sample": ("--overwrite",), "train_dit": ("train.max_steps=2",)}.get(name, ())
    write(name, assets, target, *again)  # our own earlier output: reused, extended or replaced
    assert read_marker(target)["kind"] == WRITERS[name].kind


@pytest.mark.parametrize("listing", ["listed", "unlisted"])
@pytest.mark.parametrize("name", [n for n, w in WRITERS.items() if w.temp] + ["train_dit"])
def test_a_leftover_temp_folder_of_ours_is_cleaned_up(name, listing, assets, tmp_path, caplog):
    """An interrupted earlier run left its marked temporary folder. Holding exactly what it lists, it is
    removed; holding a file it does not list, it stays byte for byte (a warning names it) and the command
    builds in a new temporary folder. Either way the command goes on."""
    from mhla_gen.outputs.folders import record_files

    target = tmp_path / "out"
    temp_parent, temp_kind = (target, "model") if name == "train_dit" else (tmp_path, WRITERS[name].kind)
    if name == "train_dit":
        write(name, assets, target)
        temp = target / ".tmp-final"
    else:
        temp = tmp_path / ".tmp-out"
    user_files(temp, ["half-written.bin"])
    write_marker(temp, temp_kind, temporary=True)
    if listing == "listed":
        record_files(temp, "half-written.bin")
    before = checksums(temp)
    write(name, assets, target, *(("train.max_steps=2",) if name == "train_dit" else ()))
    final = target / "final" if name == "train_dit" else target
    assert read_marker(final)["kind"] == temp_kind and temp_parent.is_dir()
    assert not [p for p in temp_parent.iterdir() if p.name.startswith(".tmp-") and p != temp]
    if listing == "listed":
        assert not temp.exists()
    else:
        assert checksums(temp) == before
        assert f"{temp} (left by an interrupted earlier run) stays" in caplog.text


@pytest.mark.parametrize("name", [n for n, w in WRITERS.items() if w.temp] + ["train_dit"])
def test_a_users_tmp_sibling_is_never_touched(name, assets, tmp_path):
    target = tmp_path / "out"
    if name == "train_dit":
        write(name, assets, target)
        temp = user_files(target / ".tmp-final", ["meta.json"])
    else:
        temp = user_files(tmp_path / ".tmp-out", ["meta.json"])
    refused(lambda t: write(name, assets, t), target, temp, match=r"\.tmp-.* not written by mhla_gen")


def test_convert_refuses_a_sharded_model_folder_it_did_not_write(assets, tmp_path):
    """save_pretrained into it would delete the shards and leave a stale index."""
    index = {"weight_map": {"a": "diffusion_pytorch_model-00001-of-00002.safetensors"}}
    shards = [f"diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    target = user_files(tmp_path / "model", ["config.json", *shards])
    (target / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    refused(lambda t: write("convert_wan", assets, t), target, match="not written by mhla_gen")


def test_a_users_file_inside_a_folder_of_ours_is_not_replaced_with_it(assets, tmp_path):
    """A cache is replaced as a whole: a file the user put inside stops that."""
    target = tmp_path / "out"
    write("extract_latents", assets, target)
    (target / "notes.txt").write_text("mine")
    refused(lambda t: write("extract_latents", assets, t), target, match=r"notes\.txt")


def test_a_folder_from_before_markers_is_refused_then_adopted(assets, tmp_path):
    """The explicit, named way to adopt a folder an mhla_gen without markers wrote."""
    from mhla_gen.commands.adopt import main as adopt

    target = tmp_path / "old"
    write("extract_latents", assets, target)
    (target / MARKER).unlink()  # as written before markers existed
    refused(lambda t: write("extract_latents", assets, t), target,
            match=rf"mhla-gen adopt latent_cache {target}")
    with pytest.raises(ConfigError, match="holds entries a DiT latent cache folder does not"):
        adopt(["latent_cache", str(user_files(tmp_path / "photos", ["me.jpg"]))])
    adopt(["latent_cache", str(target)])
    write("extract_latents", assets, target)


# ------------------------------------------------------------------------------------ single files
def test_fid_outputs_replace_only_their_own_files(assets, tmp_path):
    fid = load_script("eval/fid.py")
    args = ["--samples", str(assets / "samples"), "--ref", "digits", "--kid-subsets", "2", "--num", "60"]
    reference = tmp_path / "VIRTUAL_imagenet256_labeled.npz"  # e.g. a downloaded ADM reference batch
    np.savez(reference, arr_0=np.zeros((2, 8, 8, 3), np.uint8), mu=np.zeros(3), sigma=np.eye(3))
    refused(lambda t: fid.main([*args, "--save-ref-stats", str(t)]), reference, match="pass --overwrite")
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": 1}')
    refused(lambda t: fid.main([*args, "--out", str(t)]), mine, match="--out=.*notes.json.* exists")

    stats = tmp_path / "digits_stats.npz"
    fid.main([*args, "--out", str(tmp_path / "m.json"), "--save-ref-stats", str(stats)])
    fid.main([*args, "--out", str(tmp_path / "m.json"), "--save-ref-stats", str(stats)])  # ours: replaced
    fid.main([*args, "--out", str(mine), "--save-ref-stats", str(reference), "--overwrite"])  # asked
    assert json.loads(mine.read_text())["fid"] >= 0 and "mu" in np.load(reference).files


def test_fid_default_outputs_are_named_after_the_samples(assets, tmp_path):
    """Two .npz in one folder get two metrics files; nothing is written inside a samples folder."""
    fid = load_script("eval/fid.py")
    files = sorted((assets / "samples").iterdir())
    arrays = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in files])
    for name in ("a.npz", "b.npz"):
        np.savez(tmp_path / name, arr_0=arrays)
        fid.main(["--samples", str(tmp_path / name), "--ref", "digits", "--kid-subsets", "2", "--num", "60"])
    assert {p.name for p in tmp_path.glob("*.fid.json")} == {"a.fid.json", "b.fid.json"}


def test_vbench_refuses_to_replace_a_users_json(tmp_path):
    (tmp_path / "videos").mkdir()
    mine = tmp_path / "videos.vbench.json"
    mine.write_text('{"mine": 1}')
    refused(lambda t: load_script("eval/vbench.py").main(["--videos", str(tmp_path / "videos")]), mine,
            match="--out=.*exists")


def test_sample_does_not_overwrite_earlier_samples_unless_asked(assets, tmp_path):
    target = tmp_path / "out"
    write("sample", assets, target)
    refused(lambda t: write("sample", assets, t), target, match="pass --overwrite")
    write("sample", assets, target, "--overwrite")


def test_attention_stats_in_a_run_folder_leave_the_run_resumable(assets, tmp_path):
    """The README's attention_stats writes into the run folder by default; the run still extends."""
    run = tmp_path / "run"
    write("train_dit", assets, run)
    load_script("eval/attention_stats.py").main(["--model", str(run / "final"), "--batch", "1"])
    assert read_marker(run / "attention_stats")["kind"] == "attention_stats"
    write("train_dit", assets, run, "train.max_steps=2")
    assert (run / "checkpoints" / "checkpoint_2").is_dir()


def test_feature_cache_interrupted_then_the_same_command_runs(tmp_path, monkeypatch):
    """Ctrl-C while SANA/Wan build their cache left .tmp-cache in the run folder: the same command then
    cleans it up and goes on (it used to be refused forever as 'not written by mhla_gen')."""
    from test_train_sana import finetune

    from mhla_gen.testing import tiny_sana_pipeline
    from mhla_gen.train.finetune import SanaTask

    setup = tmp_path / "setup"
    tiny_sana_pipeline().save_pretrained(setup / "ckpt")
    user_files(setup / "data", ["a.txt", "b.txt"])
    for name in ("a", "b"):
        Image.new("RGB", (40, 48)).save(setup / "data" / f"{name}.png")
    original = SanaTask.encode_pixels

    def interrupted(self, pixels):
        if (tmp_path / "run" / ".tmp-cache" / "items" / "00000000.safetensors").exists():
            raise KeyboardInterrupt
        return original(self, pixels)

    monkeypatch.setattr(SanaTask, "encode_pixels", interrupted)
    with pytest.raises(KeyboardInterrupt):
        finetune(setup, tmp_path / "run", "train.max_steps=1")
    assert (tmp_path / "run" / ".tmp-cache").is_dir()
    monkeypatch.setattr(SanaTask, "encode_pixels", original)
    finetune(setup, tmp_path / "run", "train.max_steps=1")
    assert not (tmp_path / "run" / ".tmp-cache").exists() and (tmp_path / "run" / "final").is_dir()


def test_written_files_get_the_users_umask(tmp_path):
    from mhla_gen.train.io import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "config.yaml", "a: 1\n")
    finally:
        os.umask(old)
    assert (tmp_path / "config.yaml").stat().st_mode & 0o777 == 0o644


def test_digits_run_with_other_class_count_and_home_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match=r"model.num_classes=5 but data.source=digits has 10 classes"):
        run_inprocess("train_dit.py", "--config", TINY_DIT, "output_dir=~/x", "model.num_classes=5")
    run_inprocess("train_dit.py", "--config", TINY_DIT, "output_dir=~/x", "train.max_steps=1")
    assert (tmp_path / "x" / "final").is_dir() and not (REPO / "~").exists()


def test_fid_default_output_of_the_current_folder_is_named_after_it(tmp_path, monkeypatch):
    """``--samples .`` (or ``..``) puts the metrics beside the folder it names, never inside it; a path
    with no name at all (``/``) asks for --out in one line."""
    from mhla_gen.commands.fid import default_out
    from mhla_gen.errors import ConfigError

    (tmp_path / "samples").mkdir()
    monkeypatch.chdir(tmp_path / "samples")
    assert default_out(".") == tmp_path.resolve() / "samples.fid.json"
    assert default_out("..") == tmp_path.resolve().parent / f"{tmp_path.name}.fid.json"
    assert default_out("a.npz") == Path("a.fid.json")
    with pytest.raises(ConfigError, match="give --out"):
        default_out("/")


def test_sample_claims_out_only_once_the_model_loaded(assets, tmp_path, monkeypatch):
    """A model that cannot be loaded (a hub id offline, a broken folder) leaves no --out folder behind:
    --out is checked first and claimed after the load."""
    import mhla_gen.pipelines.dit

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(mhla_gen.pipelines.dit, "load_dit_pipeline", unreachable)
    with pytest.raises(OSError, match="couldn't connect"):
        write("sample", assets, tmp_path / "new" / "out")
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    write("sample", assets, tmp_path / "new" / "out")
    assert sorted(p.name for p in (tmp_path / "new" / "out").glob("*.png"))
