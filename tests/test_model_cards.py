"""Model cards (issue 54, part 2): every folder the project writes for sharing carries a README.md whose
metadata parses back with ``ModelCard.load``, names no absolute local path anywhere in what would be
shared, and whose loading snippet runs as written on the tiny folder; pushing uploads exactly that."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard
from test_convert_wan import CONFIG, _original_state, _release_like_model
from test_ownership import load_script
from train_helpers import one_per_kind, run_inprocess, tiny_config, training_script, write_captioned_videos

from mhla_gen import MHLAConfig, load_transformer
from mhla_gen.bases import BASES
from mhla_gen.errors import ConfigError
from mhla_gen.integration.cards import CARD, LOCAL_ONLY, local_paths, push_to_hub, shared_files, write_card
from mhla_gen.outputs.folders import MARKER, read_marker

DIT, SANA = BASES["dit"], BASES["sana"]  # a DiT run's card; SANA's LoRA folder and saved pipeline
DIT_CONFIG = tiny_config(DIT)
# every trained base of captions only; the card of a run samples as written, end to end (tens of seconds a
# base): one base of each kind of sample (image, video); the others' snippets are compiled below
FINE_TUNED = [base for base in BASES.values() if base.trains and not base.class_conditional]
CARD_RUNS = one_per_kind(base for base in FINE_TUNED if base.conditioning == "captions")
SANA_ID = "Efficient-Large-Model/Sana_600M_512px_diffusers"
WAN_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"


def card_of(folder: Path) -> ModelCard:
    return ModelCard.load(folder / CARD)


def assert_metadata(folder: Path, family: str, pipeline_tag: str, base_model: str | None = None) -> ModelCard:
    card = card_of(folder)
    data = card.data
    assert data.library_name == "diffusers" and data.pipeline_tag == pipeline_tag
    assert {"mhla", "mhla_gen", family} <= set(data.tags)
    assert data.base_model == base_model
    assert "## MHLA settings" in card.text and "## How to use" in card.text
    assert "pip install mhla_gen" in card.text
    return card


def assert_shareable(folder: Path, root: Path) -> None:
    """No absolute local path in any file a push would upload (text files, safetensors metadata); the local
    records (marker, listing) are never among them."""
    shared = shared_files(folder)
    assert CARD in shared and not [f for f in shared if Path(f).name.startswith(".")]
    assert local_paths(folder) == []
    for rel in shared:
        if Path(rel).suffix in (".md", ".json", ".txt", ".jsonl", ".yaml"):
            text = (folder / rel).read_text()
            assert str(root) not in text and str(root.resolve()) not in text
            assert str(Path.home()) + "/" not in text
            assert "_name_or_path" not in text or rel.endswith(CARD)


def run_snippet(folder: Path, cwd: Path, monkeypatch, **lines: str) -> dict:
    """Execute the card's Python as written, from ``cwd``; ``lines``: a variable set to another value
    (e.g. a hub id that cannot be downloaded here replaced by its local copy)."""
    code = re.search(r"```python\n(.*?)```", (folder / CARD).read_text(), re.S).group(1)
    for name, value in lines.items():
        code, count = re.subn(rf"^{name} = .*$", f"{name} = {value!r}", code, flags=re.M)
        assert count == 1, name
    monkeypatch.chdir(cwd)
    namespace: dict = {}
    exec(compile(code, str(folder / CARD), "exec"), namespace)  # noqa: S102 - the card's own snippet
    return namespace


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Tiny checkpoints of SANA and of the bases of :data:`CARD_RUNS` (each in a folder of its name) with
    captioned images and videos, side by side (a card names them by folder name: run from here, its
    snippet finds them)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("cards")
    for name in dict.fromkeys([SANA.name, *CARD_RUNS]):
        BASES[name].tiny.load().pipeline().save_pretrained(root / name)

    (root / "images").mkdir()
    for i, caption in enumerate(["a red cat", "a blue dog"]):
        Image.new("RGB", (32, 32), (40 * i, 80, 120)).save(root / "images" / f"{i}.png")
        (root / "images" / f"{i}.txt").write_text(caption)
    write_captioned_videos(root / "videos")
    return root


def finetune(base: str, root: Path, run: str, *overrides: str) -> Path:
    record = BASES[base]
    data = root / ("videos" if record.video else "images")
    run_inprocess(training_script(record), "--config", tiny_config(record), f"model.pretrained={root / base}",
                  f"data.path={data}", f"output_dir={root / run}", "train.max_steps=2", *overrides)
    return root / run / "final"


@pytest.fixture(scope="module")
def digits(root):
    """A tiny digits DiT run (FID at the end) told to push to the Hub: the upload is recorded, not made."""
    uploads = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_TOKEN", "hf_test")
        mp.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: uploads.append(("create", repo_id)))
        mp.setattr(huggingface_hub, "upload_folder", lambda **kw: uploads.append(("upload", kw)) or "commit")
        run_inprocess("train_dit.py", "--config", DIT_CONFIG, f"output_dir={root / 'digits'}",
                      "share.push_to_hub=me/digits-mhla", "share.license=apache-2.0",
                      "eval.fid_num_samples=20", "eval.fid_batch_size=10")
    return root / "digits" / "final", uploads


# ----------------------------------------------------------------------------------------- a run's final/
def test_dit_run_card_metadata_metrics_and_push(digits, root, monkeypatch):
    final, uploads = digits
    card = assert_metadata(final, DIT.name, "unconditional-image-generation")
    assert card.data.license == "apache-2.0"
    metrics = [json.loads(line) for line in (root / "digits" / "metrics.jsonl").read_text().splitlines()]
    fid = metrics[-1]["fid_digits"]
    assert f"| fid_digits | {fid:.4g} | 3 |" in card.text  # the end-of-run metric, rewritten after it
    assert f"| training loss (last logged) | {metrics[-2]['loss']:.4g} | 3 |" in card.text
    assert "| blocks | 2 × 2 (4 blocks) |" in card.text and "3 optimizer steps, global batch 8" in card.text
    assert_shareable(final, root)
    assert uploads[0] == ("create", "me/digits-mhla")
    upload = uploads[1][1]
    assert Path(upload["folder_path"]) == final and upload["repo_id"] == "me/digits-mhla"
    assert upload["ignore_patterns"] == list(LOCAL_ONLY)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(final))
    found = run_snippet(final, root, monkeypatch)  # snapshot_download("me/digits-mhla"): this folder
    assert found["transformer"].mhla_config.blocks == (2, 2) and len(found["images"]) == 3


@pytest.mark.parametrize("base", CARD_RUNS)
def test_finetune_card_loads_and_samples_as_written(root, base, monkeypatch):
    video = BASES[base].video
    final = finetune(base, root, f"{base}_full")
    tag = "text-to-video" if video else "text-to-image"
    card = assert_metadata(final, base, tag)  # a local base: not in the metadata, named in the body
    assert f"| starts from | `{base}` |" in card.text
    assert_shareable(final, root)
    found = run_snippet(final, root, monkeypatch)  # folder "<run>/final", base "<base>": relative to root
    assert type(found["pipe"].transformer).__name__.startswith("MHLA")
    assert found["video" if video else "image"] is not None


def test_lora_folder_card_manifest_and_local_record(root, tmp_path, monkeypatch):
    """mhla_lora.json recorded its base as an absolute path; now a hub id (share.base_model) and a path
    relative to the folder, the absolute one with its fingerprint in the (never pushed) marker."""
    final = finetune(SANA.name, root, "sana_lora", "train.trainable=lora", "train.lora_rank=2",
                     f"share.base_model={SANA_ID}")
    assert_metadata(final, SANA.name, "text-to-image", base_model=SANA_ID)
    assert_shareable(final, root)
    manifest = json.loads((final / "mhla_lora.json").read_text())
    assert manifest["base"] == SANA_ID and manifest["base_path"] == "../../sana"
    record = read_marker(final)["base_record"]
    assert record["path"] == str((root / SANA.name).resolve()) and record["sha256"]
    assert MARKER not in shared_files(final)
    found = run_snippet(final, root, monkeypatch, base=SANA.name)  # the hub id, here its local copy
    assert found["image"] is not None and found["pipe"].transformer.mhla_config.blocks == (2, 2)

    moved = tmp_path / "moved"  # base and LoRA moved together: the relative path finds the base
    shutil.copytree(root / SANA.name, moved / SANA.name)
    shutil.copytree(root / "sana_lora", moved / "runs" / "sana_lora")
    (moved / "runs" / "sana_lora" / "final" / MARKER).unlink()  # another machine: no local record
    manifest_copy = json.loads((moved / "runs" / "sana_lora" / "final" / "mhla_lora.json").read_text())
    manifest_copy["base_path"] = "../../../sana"
    (moved / "runs" / "sana_lora" / "final" / "mhla_lora.json").write_text(json.dumps(manifest_copy))
    loaded = load_transformer(moved / "runs" / "sana_lora" / "final")
    assert loaded.peft_config["default"].r == 2
    shutil.rmtree(moved / SANA.name)
    with pytest.raises(FileNotFoundError, match="is gone; pass base=PATH"):
        load_transformer(moved / "runs" / "sana_lora" / "final")


def test_stage1_card_names_the_teacher_by_name(root, monkeypatch):
    run_inprocess("train_dit.py", "--config", DIT_CONFIG, f"output_dir={root / 'teacher'}",
                  "model.attention=softmax", "train.max_steps=1")
    run_inprocess("linearize.py", "--config", DIT_CONFIG, f"model.init_from={root / 'teacher' / 'final'}",
                  f"output_dir={root / 'stage1'}", "train.max_steps=1")
    final = root / "stage1" / "final"
    card = assert_metadata(final, DIT.name, "unconditional-image-generation")
    assert "converted by attention transfer" in card.text
    assert "| converted from (teacher) | `teacher/final` |" in card.text
    assert "transfer_error_after" in card.text
    assert read_marker(final)["teacher"] == str((root / "teacher" / "final").resolve())  # kept, locally
    assert_shareable(final, root)
    assert run_snippet(final, root, monkeypatch)["images"]


# ------------------------------------------------------------------------------ converter and pipelines
def test_converted_wan_card(root, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from mhla_gen.testing.wan import tiny_wan_pipeline, tiny_wan_transformer

    model = _release_like_model()
    save_file(_original_state(model), tmp_path / "release.safetensors")
    tiny_wan_pipeline(tiny_wan_transformer(**CONFIG)).save_pretrained(tmp_path / "wan21")
    load_script("scripts/convert_wan_mhla.py").main([
        "--checkpoint", str(tmp_path / "release.safetensors"), "--config-from", str(tmp_path / "wan21"),
        "--out", str(tmp_path / "converted"), "--license", "apache-2.0"])
    out = tmp_path / "converted"
    card = assert_metadata(out, BASES["wan"].name, "text-to-video")
    assert card.data.license == "apache-2.0" and "`release.safetensors`" in card.text
    assert "| layers | [1, 2] (the others keep the base's attention) |" in card.text
    assert_shareable(out, tmp_path)
    found = run_snippet(out, tmp_path, monkeypatch)
    assert found["pipe"].transformer.mhla_config == model.mhla_config


def test_saved_pipeline_card_loads_with_diffusers(root, tmp_path, monkeypatch):
    from mhla_gen.pipelines.sana import load_sana_pipeline
    from mhla_gen.pipelines.saving import save_pipeline

    pipe = load_sana_pipeline(root / SANA.name, mhla=MHLAConfig(blocks=(2, 2)))
    out = save_pipeline(pipe, tmp_path / "exported", base_model=SANA_ID)
    assert_metadata(out, SANA.name, "text-to-image", base_model=SANA_ID)
    assert_shareable(out, root)
    found = run_snippet(out, tmp_path, monkeypatch)
    assert found["pipe"].transformer.mhla_config == MHLAConfig(blocks=(2, 2))
    with torch.no_grad():
        for name, p in pipe.transformer.state_dict().items():
            assert torch.equal(p, found["pipe"].transformer.state_dict()[name])
    save_pipeline(pipe, out)  # its own folder: replaced whole
    with pytest.raises(ConfigError, match="folder=.* is the pipeline's source"):
        save_pipeline(load_sana_pipeline(out), out)
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / CARD).write_text("my notes")
    with pytest.raises(ConfigError, match="not empty and was not written by mhla_gen"):
        save_pipeline(pipe, tmp_path / "users")
    assert (tmp_path / "users" / CARD).read_text() == "my notes"


# ----------------------------------------------------------------------------------- writing and pushing
def test_a_users_readme_is_never_replaced(tmp_path, caplog):
    from mhla_gen.outputs.folders import write_marker

    folder = tmp_path / "final"
    folder.mkdir()
    write_marker(folder, "model")
    (folder / CARD).write_text("mine")
    assert write_card(folder, ModelCard("---\nlicense: mit\n---\n\nours")) is None
    assert (folder / CARD).read_text() == "mine" and "did not write" in caplog.text


def test_push_refuses_local_paths_and_needs_a_token(digits, tmp_path, monkeypatch, capsys):
    from test_cli_errors import fails_in_one_line

    final, _ = digits
    leaky = tmp_path / "leaky"
    shutil.copytree(final, leaky)
    (leaky / "notes.txt").write_text(f"trained from {tmp_path}/data\n")
    with pytest.raises(ValueError, match="notes.txt: /"):
        push_to_hub(leaky, "me/x")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    line = fails_in_one_line("scripts/train_dit.py", ["--config", DIT_CONFIG, "share.push_to_hub=me/x",
                             f"output_dir={tmp_path / 'run'}"], capsys, monkeypatch)
    assert "share.push_to_hub='me/x' needs a Hugging Face token" in line and not (tmp_path / "run").exists()
    line = fails_in_one_line("scripts/train_dit.py", ["--config", DIT_CONFIG, "share.push_to_hub=not a repo",
                             f"output_dir={tmp_path / 'run'}"], capsys, monkeypatch)
    assert "share.push_to_hub='not a repo' is not a Hub repo id" in line


def test_converter_push_uploads_the_written_folder(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    calls = []
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.append(repo_id))
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: calls.append(kw))
    model = _release_like_model()
    save_file(_original_state(model), tmp_path / "release.safetensors")
    (tmp_path / "base" / "transformer").mkdir(parents=True)
    config = {k: v for k, v in model.config.items() if k != "mhla"} | {"_class_name": "WanTransformer3DModel"}
    (tmp_path / "base" / "transformer" / "config.json").write_text(json.dumps(config))
    load_script("scripts/convert_wan_mhla.py").main([
        "--checkpoint", str(tmp_path / "release.safetensors"), "--config-from", str(tmp_path / "base"),
        "--out", str(tmp_path / "out"), "--push-to-hub", "me/wan-mhla", "--base-model", WAN_ID])
    assert calls[0] == "me/wan-mhla" and Path(calls[1]["folder_path"]) == tmp_path / "out"
    card = card_of(tmp_path / "out")
    assert card.data.base_model == WAN_ID and 'snapshot_download("me/wan-mhla")' in card.text


def test_base_model_must_be_a_hub_id_before_anything_is_written(tmp_path):
    """``--base-model`` / ``base_model=`` name the base in the card's YAML and snippet as given (a hub id,
    by their help): a local path there would put an absolute path into a folder that is shared."""
    from safetensors.torch import save_file

    from mhla_gen.pipelines.saving import save_pipeline
    from mhla_gen.testing import tiny_sana_pipeline

    model = _release_like_model()
    save_file(_original_state(model), tmp_path / "release.safetensors")
    (tmp_path / "base" / "transformer").mkdir(parents=True)
    config = {k: v for k, v in model.config.items() if k != "mhla"} | {"_class_name": "WanTransformer3DModel"}
    (tmp_path / "base" / "transformer" / "config.json").write_text(json.dumps(config))
    local = str(tmp_path / "base")
    with pytest.raises(ConfigError, match=r"--base-model=.*base' is not a Hub repo id"):
        load_script("scripts/convert_wan_mhla.py").main([
            "--checkpoint", str(tmp_path / "release.safetensors"), "--config-from", local,
            "--out", str(tmp_path / "out"), "--base-model", local])
    with pytest.raises(ConfigError, match=r"base_model=.*base' is not a Hub repo id"):
        save_pipeline(tiny_sana_pipeline(), tmp_path / "exported", base_model=local)
    assert not (tmp_path / "out").exists() and not (tmp_path / "exported").exists()


@pytest.mark.parametrize("base", [base.name for base in FINE_TUNED])
def test_every_base_gets_loading_lines_that_compile(base, tmp_path):
    """Every fine-tuned base (the ones not run end to end above too): its snippet is valid Python calling
    the record's pipeline with the transformer in its slot, sampling frames for video, from a first frame
    where the base needs an image."""
    record = BASES[base]
    code = _usage(record, tmp_path)
    assert f"{record.pipeline_class}.from_pretrained(base, transformer=transformer)" in code, code
    assert ("frames=5" in code) == record.video and ("image=first_frame" in code) == record.image_conditioned


@pytest.mark.parametrize("overrides, expected", [
    (["model.expert=transformer_2"], "WanPipeline.from_pretrained(base, transformer_2=transformer)"),
    (["model.expert=transformer_2", "train.trainable=lora"],
     "load_lora_weights(pipe, folder, load_into_transformer_2=True)"),
])
def test_a_wan22_expert_loads_into_its_slot(overrides, expected, tmp_path):
    assert expected in _usage(BASES["wan"], tmp_path, *overrides)


def _usage(record, tmp_path, *overrides) -> str:
    """The card's Python for a run of ``record`` on the tiny config from a hub base (compiled here)."""
    from mhla_gen.train.card import usage
    from mhla_gen.train.config import load_config

    overrides = ["model.pretrained=Org/base", *overrides]
    cfg = load_config(record.run_config.load(), tiny_config(record), overrides)
    folder = tmp_path / "final"
    folder.mkdir()
    if "train.trainable=lora" in overrides:
        (folder / "mhla_lora.json").write_text("{}")
    code = "\n".join(usage(cfg, record, folder, "me/model", "run/final").lines())
    compile(code, "card", "exec")
    assert 'base = "Org/base"' in code and 'snapshot_download("me/model")' in code
    return code


def test_a_failed_upload_says_how_to_retry(digits, monkeypatch):
    from mhla_gen.train import loop

    def offline(**kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: None)
    monkeypatch.setattr(huggingface_hub, "upload_folder", offline)
    with pytest.raises(RuntimeError, match=r"complete: retry with mhla_gen.integration.cards.push_to_hub\("):
        loop._push(digits[0], "me/digits-mhla")
