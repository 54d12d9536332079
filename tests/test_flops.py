"""mhla_gen.metrics.flops for training budgets: FLOPs of a training image counted from the model (the
attention's share checked against its formula), a converted model's compute with and without its teacher, and
the compute every evaluation point of studies.experiments records."""

import dataclasses

import pytest
import torch
from studies.experiments import stage1_summary, training_compute
from torch.utils.flop_counter import sdpa_flop_count

from mhla_gen.configs import CONFIG_DIR
from mhla_gen.metrics.flops import Conversion, mhla_forward_flops
from mhla_gen.train.config import DiTRunConfig, load_config
from mhla_gen.train.dit_flops import train_flops_per_image

DEPTH, HEADS, HEAD_DIM, SIDE = 2, 2, 8, 6  # a 6x6 token grid: 36 tokens, blocks 3x2 of uneven size


def config(attention: str, *more: str):
    return load_config(DiTRunConfig, str(CONFIG_DIR / "dit_digits.yaml"), [
        "data.resolution=12", "model.patch_size=2", f"model.hidden_size={HEADS * HEAD_DIM}",
        f"model.depth={DEPTH}", f"model.heads={HEADS}", f"model.attention={attention}", "mhla.blocks=[3,2]",
        *more])


def test_flops_per_image_differ_by_the_attention_alone():
    """Softmax, linear and MHLA models differ only in their attention: the counted forward FLOPs differ by
    depth x (SDPA's formula - the MHLA op's), for one image; a training step adds the backward."""
    n, shape = SIDE * SIDE, (1, HEADS, SIDE * SIDE, HEAD_DIM)
    flops = {a: train_flops_per_image(config(a)) for a in ("softmax", "linear", "mhla")}
    sdpa = sdpa_flop_count(shape, shape, shape)
    assert sdpa == 4 * HEADS * n * n * HEAD_DIM
    linear, mhla = (mhla_forward_flops(shape, shape, blocks) for blocks in ((1,), (3, 2)))
    forward = {a: f["forward"] for a, f in flops.items()}
    assert forward["softmax"] - forward["linear"] == DEPTH * (sdpa - linear)
    assert forward["mhla"] - forward["linear"] == DEPTH * (mhla - linear)
    for f in flops.values():  # a backward costs about twice a forward (weights and inputs)
        assert 2.5 * f["forward"] < f["train"] < 3.5 * f["forward"]


def test_a_converted_run_is_counted_from_its_config_not_its_weights(tmp_path):
    """``model.init_from`` (here a folder that does not exist) is not loaded: the count is the config's."""
    plain = config("mhla")
    converted = dataclasses.replace(plain, model=dataclasses.replace(plain.model, init_from=str(tmp_path)))
    assert train_flops_per_image(converted) == train_flops_per_image(plain)


def test_conversion_compute_at_equal_total_and_with_the_teacher_sunk():
    c = Conversion(teacher=1000.0, stage1=50.0, stage2_step=2.0)
    assert c.total(100) == 1250.0 and c.after_teacher(100) == 250.0
    assert c.scratch_steps(100, scratch_step=2.5) == 500.0  # 1250 FLOPs at 2.5 a step
    assert c.scratch_steps(100, scratch_step=2.5, sunk_teacher=True) == 100.0
    assert Conversion(stage2_step=3.0).total(10) == 30.0  # from scratch: no teacher, no stage 1


def test_every_point_records_its_compute_and_a_conversion_adds_stage1_and_teacher():
    cfg = config("mhla", "train.global_batch_size=8")
    with torch.no_grad():  # as in an evaluation
        point = training_compute(cfg, 10)
    per_image = train_flops_per_image(cfg)["train"]
    assert point == {"flops_per_image": per_image, "batch": 8, "train_flops": 10 * 8 * per_image}
    report = {"steps": 5, "wall_seconds": 1.0, "teacher_forward_equivalents": 20.0, "softmax_layers": [],
              "errors_before": {0: 0.5}, "errors_after": {0: 0.1}, "teacher_forward_flops": 300.0}
    stage1 = stage1_summary(report)
    assert stage1["flops"] == 20.0 * 300.0  # stage 1 in forwards of the teacher, times the forward's FLOPs
    record = {**point, "step": 10, "stage1": stage1, "teacher_flops": 1e6}
    c = Conversion.of_point(record)
    assert c.total(10) == 1e6 + 6000.0 + point["train_flops"]
    assert c.after_teacher(10) == 6000.0 + point["train_flops"]
    assert Conversion.of_point(point).total(10) == point["train_flops"]  # from scratch
    old = {k: v for k, v in report.items() if k != "teacher_forward_flops"}
    assert stage1_summary(old)["flops"] != stage1_summary(old)["flops"]  # NaN: an older report
    with pytest.raises(KeyError):
        Conversion.of_point({"step": 1})  # a point of before 2026-11-28 has no compute to add up
