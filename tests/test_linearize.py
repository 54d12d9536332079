"""scripts/linearize.py (stage 1 of the converter) and stage 2 continuing from its folder: tiny DiT, SANA
and Wan; the hybrid choice; exact resume; what is refused before any work."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from PIL import Image
from train_helpers import (
    final_weights,
    max_abs_diff,
    one_per_kind,
    read_metrics,
    run_inprocess,
    run_killed,
    run_torchrun,
    tiny_config,
    training_script,
    write_captioned_videos,
)

from mhla_gen import MHLAConfig, install_mhla, load_transformer
from mhla_gen.bases import BASES
from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import read_marker
from mhla_gen.processors import MHLAProcessor

DIT, SANA, WAN = BASES["dit"], BASES["sana"], BASES["wan"]  # the tests of one base's own conversion
DIT_CONFIG = tiny_config(DIT)
# teacher data from a prompt file, end to end (tens of seconds a base): one base of each kind that samples
# its teacher from prompts (text to image, text to video)
PROMPT_TEACHERS = one_per_kind(base for base in BASES.values()
                               if "teacher" in base.data_sources and not base.class_conditional)


@pytest.fixture(scope="module")
def dit_teacher(tmp_path_factory):
    """A softmax DiT trained a few steps on the digits, its layer 1 made hard for linear attention (sharp
    softmax: q and k scaled up), so auto:1 must keep that layer."""
    root = tmp_path_factory.mktemp("dit_teacher")
    run_inprocess("train_dit.py", "--config", DIT_CONFIG, f"output_dir={root / 'run'}",
                  "model.attention=softmax", "train.max_steps=20", "model.depth=3")
    teacher = load_transformer(root / "run" / "final")
    with torch.no_grad():
        for name in ("to_q", "to_k"):
            getattr(teacher.transformer_blocks[1].attn1, name).weight.mul_(6.0)
    teacher.save_pretrained(root / "teacher")
    return root / "teacher"


def linearize(*args):
    run_inprocess("linearize.py", *args)


def dit_stage1(teacher, out, *overrides):
    linearize("--config", DIT_CONFIG, f"model.init_from={teacher}", f"output_dir={out}", "model.depth=3",
              "train.max_steps=6", "train.learning_rate=3e-3", *overrides)


def test_dit_stage1_lowers_the_errors_keeps_the_hardest_layer_and_feeds_stage2(dit_teacher, tmp_path):
    dit_stage1(dit_teacher, tmp_path / "s1", "hybrid.softmax_layers=auto:1", "mhla.cpe_kernel=3")
    report = json.loads((tmp_path / "s1" / "transfer.json").read_text())
    before, after = report["errors_before"], report["errors_after"]
    assert set(before) == set(after) == {"0", "1", "2"}
    assert np.mean(list(after.values())) < np.mean(list(before.values()))
    assert report["softmax_layers"] == [1] and report["mhla_layers"] == [0, 2]  # the planted hardest layer
    assert report["teacher_forward_equivalents"] > report["steps"]  # a teacher forward plus the students
    assert (tmp_path / "s1" / "transfer_errors.png").stat().st_size > 0
    final = tmp_path / "s1" / "final"
    assert read_marker(final)["teacher"] == str(dit_teacher)
    model = load_transformer(final)
    assert model.mhla_config.layers == [0, 2] and model.mhla_config.cpe_kernel == 3
    assert not isinstance(model.transformer_blocks[1].attn1.processor, MHLAProcessor)

    # stage 2 continues from the folder: its MHLA layers and weights, recorded in config.yaml
    run_inprocess("train_dit.py", "--config", DIT_CONFIG, f"output_dir={tmp_path / 's2'}", "model.depth=3",
                  f"model.init_from={final}", "train.max_steps=1", "train.learning_rate=1e-12",
                  "train.ema_decay=0")
    assert "layers:\n  - 0\n  - 2" in (tmp_path / "s2" / "config.yaml").read_text()
    # one AdamW step (no weight decay) moves a weight by |lr * m / (sqrt(v) + eps)| <= lr; rounded to fp32
    # it moves by 0 (a step under half an ulp) or by at most 3 lr (half an ulp of the result added)
    assert max_abs_diff(final_weights(tmp_path / "s2"), final_weights(tmp_path / "s1")) <= 3e-12


def test_end_to_end_term_lowers_the_end_to_end_error_and_is_counted(dit_teacher, tmp_path):
    """transfer.output_weight adds the converted model's output error to stage 1's objective: with every
    converted attention module training, the end-to-end error drops below the plain conversion's more
    than with the per-layer errors alone, and the second forward is counted in the stage's cost."""
    reports = {}
    for weight in (0, 10):
        out = tmp_path / f"w{weight}"
        dit_stage1(dit_teacher, out, "transfer.trainable=all", f"transfer.output_weight={weight}",
                   "train.max_steps=12")
        reports[weight] = json.loads((out / "transfer.json").read_text())
    plain, e2e = reports[0], reports[10]
    assert e2e["output_weight"] == 10 and plain["output_weight"] == 0
    assert e2e["end_to_end_before"] == plain["end_to_end_before"]  # the same plain conversion
    assert e2e["end_to_end_after"] < plain["end_to_end_after"] < plain["end_to_end_before"], reports
    assert e2e["stage1_step_flops"] > 1.5 * plain["stage1_step_flops"]  # a second forward and its backward


@pytest.mark.slow
def test_two_processes_match_one_with_the_end_to_end_term(dit_teacher, tmp_path):
    """Stage 1 with the end-to-end term (two forwards before one backward) on two real gloo processes
    (DDP) is the one-process run with the same global batch: same losses and weights. Each relative
    error is normalised by the teacher's power over the whole batch, not each process's shard. The world
    size is asserted from inside the run."""
    args = ("--config", DIT_CONFIG, f"model.init_from={dit_teacher}", "model.depth=3", "train.max_steps=3",
            "train.learning_rate=3e-3", "transfer.output_weight=10", "log.sample_every=0", "log.every=1")
    linearize(*args, f"output_dir={tmp_path / 'one'}")
    two = run_torchrun("linearize.py", *args, f"output_dir={tmp_path / 'two'}")
    assert two.returncode == 0, two.stderr[-3000:]
    one_records = [r for r in read_metrics(tmp_path / "one") if "loss" in r]
    two_records = [r for r in read_metrics(tmp_path / "two") if "loss" in r]
    assert {r["num_processes"] for r in two_records} == {2} and len(two_records) == 3
    torch.testing.assert_close(torch.tensor([r["loss"] for r in two_records]),
                               torch.tensor([r["loss"] for r in one_records]), rtol=1e-5, atol=1e-7)
    assert max_abs_diff(final_weights(tmp_path / "one"), final_weights(tmp_path / "two")) < 1e-5
    report = json.loads((tmp_path / "two" / "transfer.json").read_text())
    assert report["output_weight"] == 10 and report["end_to_end_after"] < report["end_to_end_before"]


@pytest.mark.slow
def test_stage2_distillation_on_two_processes_matches_one(dit_teacher, tmp_path):
    """Stage 2 with both distillation terms: two gloo processes train as one with the same global batch
    (each relative error normalised over the whole batch). World size asserted from inside the run."""
    dit_stage1(dit_teacher, tmp_path / "s1", "train.max_steps=1")
    args = ("--config", DIT_CONFIG, f"model.init_from={tmp_path / 's1' / 'final'}", "train.max_steps=2",
            "train.ema_decay=0", "log.sample_every=0", "train.distill.output_weight=1",
            "train.distill.attention_weight=1")
    run_inprocess("train_dit.py", *args, f"output_dir={tmp_path / 'one'}")
    two = run_torchrun("train_dit.py", *args, f"output_dir={tmp_path / 'two'}")
    assert two.returncode == 0, two.stderr[-3000:]
    one_records, two_records = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["num_processes"] for r in two_records] == [2, 2]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in two_records]),
                               torch.tensor([r["loss"] for r in one_records]), rtol=1e-5, atol=1e-7)
    assert max_abs_diff(final_weights(tmp_path / "one"), final_weights(tmp_path / "two")) < 1e-5


def test_fixed_hybrid_layers_and_refusals(dit_teacher, tmp_path):
    dit_stage1(dit_teacher, tmp_path / "fixed", "hybrid.softmax_layers=[0]", "train.max_steps=1")
    assert json.loads((tmp_path / "fixed" / "transfer.json").read_text())["softmax_layers"] == [0]
    bad = {
        "hybrid.softmax_layers=auto:3": "K=3 must leave at least one of the 3 converted layers",
        "hybrid.softmax_layers=[0,1,2]": "leave at least one as MHLA",
        "hybrid.softmax_layers=auto:x": "must be null, auto:K or a list",
        "model.attention=softmax": "leaves nothing to convert",
        "train.trainable=mhla": "leave train.trainable",
        "transfer.trainable=qk": "transfer.trainable must be one of",
        "transfer.output_weight=-1": "transfer.output_weight must be a finite number >= 0",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            dit_stage1(dit_teacher, tmp_path / "bad", override)
    with pytest.raises(ConfigError, match="already runs MHLA"):  # a teacher without its own attention
        dit_stage1(tmp_path / "fixed" / "final", tmp_path / "bad")
    with pytest.raises(ConfigError, match="model.init_from is required"):
        linearize("--config", DIT_CONFIG, f"output_dir={tmp_path / 'bad'}")
    assert not (tmp_path / "bad").exists()


def test_stage1_killed_and_resumed_ends_like_an_uninterrupted_run(dit_teacher, tmp_path):
    args = ["linearize", "--config", DIT_CONFIG, f"model.init_from={dit_teacher}", "model.depth=3",
            "train.max_steps=4", "train.checkpoint_every=2", "transfer.trainable=mhla+qk"]
    killed = run_killed("kill_after_step=3", *args, f"output_dir={tmp_path / 'killed'}")
    assert killed.returncode == -9, killed.stderr[-2000:]
    linearize(*args[1:], f"output_dir={tmp_path / 'killed'}")
    linearize(*args[1:], f"output_dir={tmp_path / 'straight'}")
    assert [r["step"] for r in read_metrics(tmp_path / "killed")][:4] == [1, 2, 3, 4]
    assert max_abs_diff(final_weights(tmp_path / "killed"), final_weights(tmp_path / "straight")) == 0.0


@pytest.fixture(scope="module")
def sana_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sana")
    SANA.tiny.load().pipeline().save_pretrained(root / "ckpt")
    rng = np.random.default_rng(0)
    (root / "data").mkdir()
    for i, caption in enumerate(["a red cat", "a blue dog", "a small cat", "a green dog"]):
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(root / "data" / f"{i}.png")
        (root / "data" / f"{i}.txt").write_text(caption)
    return root


def test_sana_stage1_from_its_own_linear_attention_and_stage2_from_the_folder(sana_setup, tmp_path):
    """SANA's teacher is its global linear attention: with uniform mixing (eps / M) the converted model
    starts at zero error; the folder then feeds finetune_sana.py's model.init_from and the pipeline."""
    from mhla_gen.pipelines.sana import load_sana_pipeline

    common = ["--config", tiny_config(SANA), f"model.pretrained={sana_setup / 'ckpt'}",
              f"data.path={sana_setup / 'data'}", "train.max_steps=2"]
    linearize("--base", SANA.name, *common, f"output_dir={tmp_path / 's1'}", "mhla.mixing_init=uniform",
              f"mhla.eps={1e-15 / 4}")
    report = json.loads((tmp_path / "s1" / "transfer.json").read_text())
    assert max(report["errors_before"].values()) < 1e-10
    run_inprocess(training_script(SANA), *common, f"output_dir={tmp_path / 's2'}",
                  f"model.init_from={tmp_path / 's1' / 'final'}", "train.distill.attention_weight=1")
    pipe = load_sana_pipeline(sana_setup / "ckpt", transformer_path=tmp_path / "s2" / "final")
    assert pipe.transformer.mhla_config.mixing_init == "uniform"
    assert all(np.isfinite(r["loss"]) for r in read_metrics(tmp_path / "s2"))


def test_wan_stage1_hybrid_with_cpe(tmp_path):
    WAN.tiny.load().pipeline().save_pretrained(tmp_path / "ckpt")
    write_captioned_videos(tmp_path / "data")
    linearize("--base", WAN.name, "--config", tiny_config(WAN), f"model.pretrained={tmp_path / 'ckpt'}",
              f"data.path={tmp_path / 'data'}", f"output_dir={tmp_path / 's1'}", "train.max_steps=2",
              "mhla.layers=null", "mhla.cpe_kernel=3", "hybrid.softmax_layers=auto:1",
              "transfer.trainable=all")
    report = json.loads((tmp_path / "s1" / "transfer.json").read_text())
    assert len(report["softmax_layers"]) == 1 and len(report["mhla_layers"]) == 2
    assert load_transformer(tmp_path / "s1" / "final").mhla_config.layers == report["mhla_layers"]


def test_distillation_terms_vanish_against_an_identical_teacher():
    """The output and attention terms compare the model with the frozen teacher on the same input: zero
    when the teacher is the model itself, positive when the MHLA layers differ."""
    from mhla_gen.train.distill import Distiller

    model = install_mhla(DIT.tiny.load().model(), MHLAConfig(blocks=(2, 2))).eval()
    x = torch.randn(2, model.config.in_channels, model.config.sample_size, model.config.sample_size)
    inputs = {"hidden_states": x, "timestep": torch.tensor([5, 9]), "class_labels": torch.tensor([1, 2])}
    distiller = Distiller(copy.deepcopy(model), model, output_weight=1.0, attention_weight=1.0)
    assert distiller(model(**inputs, return_dict=False)[0], inputs).item() == 0.0
    with torch.no_grad():
        model.transformer_blocks[0].attn1.processor.mixing.weight.mul_(3.0)
    assert distiller(model(**inputs, return_dict=False)[0], inputs).item() > 0.0


def test_starting_from_an_mhla_folder_fresh_or_refused(dit_teacher, tmp_path):
    dit_stage1(dit_teacher, tmp_path / "s1", "train.max_steps=1")
    final = tmp_path / "s1" / "final"
    common = ["--config", DIT_CONFIG, "model.depth=3", f"model.init_from={final}", "train.max_steps=1"]
    with pytest.raises(ConfigError, match="was saved with MHLA, which model.attention=softmax would drop"):
        run_inprocess("train_dit.py", *common, f"output_dir={tmp_path / 'bad'}", "model.attention=softmax")
    with pytest.raises(ConfigError, match="train.distill needs a teacher"):
        run_inprocess("train_dit.py", "--config", DIT_CONFIG, f"output_dir={tmp_path / 'bad'}",
                      "train.distill.output_weight=1")
    assert not (tmp_path / "bad").exists()
    run_inprocess("train_dit.py", *common, f"output_dir={tmp_path / 'fresh'}", "model.init_attention=fresh",
                  "mhla.blocks=[1,1]", "train.learning_rate=1e-12", "train.ema_decay=0")
    fresh = load_transformer(tmp_path / "fresh" / "final")
    assert fresh.mhla_config.blocks == (1, 1) and fresh.mhla_config.layers is None
    trained = load_transformer(final)
    q = [m.transformer_blocks[0].attn1.to_q.weight for m in (fresh, trained)]
    assert torch.allclose(*q)  # the folder's projections, fresh attention


def test_teacher_data_is_sampled_resumably_and_trains(dit_teacher, tmp_path):
    """data.source=teacher: samples of the teacher through DiTPipeline, in the latent-cache layout, chunk by
    chunk (a run killed half-way redoes only the missing chunks, with the same numbers)."""
    from mhla_gen.data.teacher import write_teacher_samples

    calls = []

    def generate(labels, chunk):
        calls.append(chunk)
        if chunk == 1 and len(calls) == 2:
            raise KeyboardInterrupt  # killed while sampling the second chunk
        return torch.full((len(labels), 1, 4, 4), float(chunk)) + torch.arange(4.0)

    args = (tmp_path / "data", [0, 1, 2, 0, 1], {"v": 1}, {"vae": None})
    with pytest.raises(KeyboardInterrupt):
        write_teacher_samples(generate, *args, chunk=2)
    write_teacher_samples(generate, *args, chunk=2)
    assert calls == [0, 1, 1, 2]  # chunk 0 was kept
    latents = np.load(tmp_path / "data" / "latents.npy")
    assert latents.shape == (5, 2, 1, 4, 4) and latents[4, 0, 0, 0, 0] == 2.0  # chunk 2, seed 2
    assert np.array_equal(latents[:, 1], latents[:, 0, ..., ::-1])  # each sample and its flip

    out = tmp_path / "run"
    common = ["--config", DIT_CONFIG, "model.depth=3", "data.source=teacher", f"data.teacher={dit_teacher}"]
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "x.png").write_bytes(b"mine")
    with pytest.raises(ConfigError, match="data.path=.* not written by mhla_gen"):
        run_inprocess("train_dit.py", *common, "data.teacher_samples=8", f"data.path={tmp_path / 'photos'}",
                      f"output_dir={out}")
    with pytest.raises(ConfigError, match="teacher_samples >= 1"):
        run_inprocess("train_dit.py", *common, f"data.path={tmp_path / 'tdata'}", f"output_dir={out}")
    run_inprocess("train_dit.py", *common, "data.teacher_samples=16", f"data.path={tmp_path / 'tdata'}",
                  f"output_dir={out}", "train.max_steps=2", "log.sample_steps=2")
    meta = json.loads((tmp_path / "tdata" / "meta.json").read_text())
    assert meta["count"] == 16 and meta["teacher"] == str(dit_teacher)
    assert read_marker(tmp_path / "tdata")["kind"] == "teacher_data" and len(read_metrics(out)) == 2


@pytest.mark.parametrize("base", PROMPT_TEACHERS)
def test_teacher_data_from_a_prompt_file(base, tmp_path):
    """data.source=teacher with a prompt file: images / videos sampled from the checkpoint's own pipeline
    into a captioned folder of the project, then cached and trained on; resumable sample by sample."""
    record = BASES[base]
    record.tiny.load().pipeline().save_pretrained(tmp_path / "ckpt")
    (tmp_path / "prompts.txt").write_text("a red cat\n\na blue dog\n")
    common = ["--config", tiny_config(record), f"model.pretrained={tmp_path / 'ckpt'}", "data.source=teacher",
              f"data.path={tmp_path / 'tdata'}", f"output_dir={tmp_path / 'run'}", "train.max_steps=1",
              "log.sample_steps=2"]
    with pytest.raises(ConfigError, match="needs data.prompts_file"):
        run_inprocess(training_script(record), *common)
    run_inprocess(training_script(record), *common, f"data.prompts_file={tmp_path / 'prompts.txt'}",
                  "data.teacher_samples=3", "train.global_batch_size=2")
    suffix = record.sample_suffix
    names = sorted(p.name for p in (tmp_path / "tdata").glob(f"*{suffix}"))
    assert names == [f"00000{i}{suffix}" for i in range(3)]
    assert (tmp_path / "tdata" / "000002.txt").read_text() == "a red cat"
    assert json.loads((tmp_path / "run" / "cache" / "meta.json").read_text())["count"] == 3


def test_stage2_teacher_data_and_distillation_follow_the_recorded_teacher(dit_teacher, tmp_path):
    """Starting from a stage-1 folder, data.source=teacher and train.distill use the model it converted,
    not the (MHLA) folder itself."""
    from mhla_gen.train.config import DiTRunConfig, load_config
    from mhla_gen.train.dit import DiTTask

    dit_stage1(dit_teacher, tmp_path / "s1", "train.max_steps=1")
    overrides = [f"model.init_from={tmp_path / 's1' / 'final'}", "model.depth=3", "data.source=teacher",
                 "data.teacher_samples=4", f"data.path={tmp_path / 'd'}"]
    cfg = load_config(DiTRunConfig, DIT_CONFIG, overrides)
    task = DiTTask(cfg)
    assert task.source.teacher() == task.distill_source() == str(dit_teacher)
