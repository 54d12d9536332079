"""eval/stream_study.py: the streaming measurement's plumbing (train, stream, score, costs, report) at the
smoke size, and its verdicts on synthetic records whose answer is known."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from mhla_gen.errors import ConfigError

EVAL = Path(__file__).resolve().parents[1] / "eval"
sys.path.insert(0, str(EVAL))

import stream_bed as bed  # noqa: E402
import stream_report as report  # noqa: E402
import stream_study as study  # noqa: E402


def test_smoke_run_writes_records_costs_and_page_and_resumes(tmp_path):
    out = tmp_path / "stream"
    argv = ["--out", str(out), "--size", "smoke", "--arms", "softmax-kv", "mhla-factorised", "--seeds", "1"]
    study.main(argv)
    size = bed.SIZES["smoke"]
    records = report.load_records(out, bed.ARMS, 1)
    assert set(records) == {"softmax-kv", "mhla-factorised"}
    for arm, per_seed in records.items():
        assert per_seed[0]["all"].shape == (size.eval_clips, size.longest), arm
        assert per_seed[0]["loss_steps"][-1] == size.steps
    costs = json.loads((out / "costs.json").read_text())["arms"]
    softmax = [row["cache_bytes"] for row in costs["softmax-kv"]]
    factorised = [row["cache_bytes"] for row in costs["mhla-factorised"]]
    assert len(softmax) == size.longest // size.chunk
    assert all(b > a for a, b in zip(softmax, softmax[1:]))  # the KV cache grows every chunk
    assert len(set(factorised[1:])) == 1 and factorised[1] > 0  # one state per block, any length
    peaks = {arm: [row["peak_bytes"] for row in rows[1:]] for arm, rows in costs.items()}
    assert len(set(peaks["mhla-factorised"])) == 1  # measured: flat from the second chunk on
    assert all(b > a for a, b in zip(peaks["softmax-kv"], peaks["softmax-kv"][1:]))
    page = (out / "streaming.md").read_text()
    assert "python eval/stream_study.py --out" in page and "| primary |" in page
    record = study.results.load(out / "record.npz")  # the page and the plot render from it alone
    assert [(p["arm"], p["seed"], p["step"]) for p in record.points] == [
        ("softmax-kv", 0, size.steps), ("mhla-factorised", 0, size.steps)]
    assert record.points[0]["commit"] == study.results.code_commit() and record.meta["costs"] == costs
    assert record.meta["questions"] == report.QUESTIONS  # the questions this run was asked
    np.testing.assert_array_equal(record.arrays[0]["all"], records["softmax-kv"][0]["all"])
    again = tmp_path / "again"
    files = ["streaming.md", "streaming_curves.png"]
    assert sorted(p.name for p in study.results.render(record, again)) == files
    assert (again / "streaming.md").read_bytes() == (out / "streaming.md").read_bytes()
    assert study.results.same_output(again / files[1], out / files[1]) != "differs"
    kept = torch.load(bed.state_path(out, "softmax-kv", 0), weights_only=True)  # the last state stays
    assert kept["step"] == size.steps and kept["log"][-1]["step"] == size.steps
    stamp = bed.record_path(out, "softmax-kv", 0).stat().st_mtime_ns
    study.main([*argv, "--stage", "train"])  # finished records are kept, not redone
    assert bed.record_path(out, "softmax-kv", 0).stat().st_mtime_ns == stamp
    before = {f: f.stat().st_mtime_ns for f in out.rglob("*")}
    for stage in ("train", "costs", "report"):  # another size would mix into, or mislabel, these files
        with pytest.raises(ConfigError, match=r"made with steps=2; this command asks steps=3"):
            study.main([*argv, "--stage", stage, "--steps", "3"])
    assert {f: f.stat().st_mtime_ns for f in out.rglob("*")} == before


@pytest.mark.parametrize("argv, name", [(["--arms", "softmax"], "--arms"), (["--seeds", "0"], "--seeds"),
                                        (["--steps", "0"], "--steps"), (["--device", "gpu0"], "--device"),
                                        (["--checkpoint-every", "-1"], "--checkpoint-every"),
                                        (["--stage", "report"], "no finished record"),
                                        *([(["--device", "cuda"], "no CUDA device")]
                                          if not torch.cuda.is_available() else [])])
def test_bad_settings_are_refused_before_the_folder_is_made(tmp_path, argv, name):
    with pytest.raises(ConfigError, match=name):
        study.main(["--out", str(tmp_path / "out"), *argv])
    assert not (tmp_path / "out").exists()


class Killed(Exception):
    pass


def test_a_killed_training_run_resumes_exactly(tmp_path, monkeypatch):
    """Killed at step 10 with its state kept every 4 steps, the run continues from step 8 and ends with the
    uninterrupted run's weights and losses, bit for bit; a state of another size is refused."""
    size = replace(bed.SIZES["smoke"], steps=12, warmup=3)
    data = bed.training_clips(size)
    whole, whole_log = bed.train_arm(size, "mhla-factorised", 0, *data)
    resume = bed.Resume(tmp_path / "training" / "state.pt", 4)
    real = bed.StepRandom

    def kill_at_10(seed, step, batch):
        if step == 10:
            raise Killed
        return real(seed, step, batch)

    monkeypatch.setattr(bed, "StepRandom", kill_at_10)
    with pytest.raises(Killed):
        bed.train_arm(size, "mhla-factorised", 0, *data, resume=resume)
    monkeypatch.setattr(bed, "StepRandom", real)
    assert torch.load(resume.path, weights_only=True)["step"] == 8
    resumed, log = bed.train_arm(size, "mhla-factorised", 0, *data, resume=resume)
    assert [(r["step"], r["loss"]) for r in log] == [(r["step"], r["loss"]) for r in whole_log]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="another size"):
        bed.train_arm(replace(size, steps=16), "mhla-factorised", 0, *data, resume=resume)


def synthetic(rates: dict[str, float], size: bed.Size, clips: int = 200, seeds: int = 3) -> dict:
    """Records whose frames pass every check with the given rate per arm (the same rate in every frame)."""
    records = {}
    for arm, rate in rates.items():
        for seed in range(seeds):
            rng = np.random.default_rng([seed, len(arm)])
            frames = size.frames if arm == "mhla-general" else size.longest
            records.setdefault(arm, {})[seed] = {check: rng.random((clips, frames)) < rate
                                                 for check in bed.CHECKS}
    return records


def verdicts(records: dict, size: bed.Size, asked=report.QUESTIONS) -> dict:
    cells = report.questions(records, size, asked)
    return {(c["a"][0], c["a"][1], c["b"][0], c["b"][1], c["check"]): c["verdict"] for c in cells}


def test_verdicts_follow_the_evidence_rules():
    size = replace(bed.SIZES["smoke"], frames=2, lengths=(1, 2, 4, 8))
    found = verdicts(synthetic({"softmax-kv": 0.5, "global-state": 0.2, "mhla-general": 0.0,
                                "mhla-factorised": 0.5}, size), size)
    assert found[("mhla-factorised", "long", "global-state", "long", "colour")] == "resolved"  # 0.3 apart
    assert found[("mhla-factorised", "1x", "softmax-kv", "1x", "colour")] in (
        "bounded", "negligible", "undecided")
    assert found[("mhla-general", "1x", "mhla-factorised", "1x", "colour")] == "resolved"
    nothing = verdicts(synthetic({arm: 0.0 for arm in bed.ARMS}, size), size)
    assert set(nothing.values()) == {"neither"}  # both at the floor: not equivalence
    two_seeds = verdicts(synthetic({arm: 0.5 for arm in bed.ARMS}, size, seeds=2), size)
    assert set(two_seeds.values()) == {"too few seeds"}
    general_only = {"mhla-general": synthetic({"mhla-general": 0.5}, size)["mhla-general"]}
    long = report.paired({**general_only, "mhla-factorised": general_only["mhla-general"]},
                         ("mhla-general", "long"), ("mhla-factorised", "long"), size)
    assert long is None  # the general mixing streams the training length only


def test_the_floor_counts_clips_not_frames():
    """A clip is one sample of a window's rate: 1 clip in 90 passing every frame is a pooled rate whose
    Wilson bound (0.06) is above the floor, though its 32 frames of 2880 would put it under (0.016)."""
    one_clip = np.zeros((3, 30))
    one_clip[0, 0] = 1.0
    assert not report.at_floor(one_clip)
    assert report.at_floor(np.zeros((3, 100)))  # none of 300 clips: bound 0.013
    assert not report.at_floor(np.zeros((3, 30)))  # none of 90 clips is too few to say so: bound 0.041


def test_each_record_is_read_with_the_questions_its_run_declared():
    """The 2026-11-28 runs asked on ``all`` (their records carry no questions); a record of today's code
    carries ``QUESTIONS`` (primary on ``colour``), so a record renders the verdicts its run was asked for."""
    size = replace(bed.SIZES["smoke"], frames=2, lengths=(1, 2, 4, 8))
    assert report.QUESTIONS[0] == ["mhla-factorised", "long", "global-state", "long", "colour"]
    assert report.QUESTIONS[-1] == report.QUESTIONS_2026_11_28[0]
    assert {q[4] for q in report.QUESTIONS_2026_11_28} == {"all"}
    records = synthetic({"softmax-kv": 0.5, "global-state": 0.2, "mhla-general": 0.5,
                         "mhla-factorised": 0.5}, size)
    for arm in records:  # colour passes everywhere, `all` at the arm's rate
        for r in records[arm].values():
            r["colour"] = np.ones_like(r["colour"])
    now, then = verdicts(records, size), verdicts(records, size, report.QUESTIONS_2026_11_28)
    assert now[("mhla-factorised", "long", "global-state", "long", "colour")] == "bounded"
    assert then[("mhla-factorised", "long", "global-state", "long", "all")] == "resolved"
    committed = study.results.load(EVAL.parent / "docs/results/records/streaming_300/record.npz")
    assert "questions" not in committed.meta
    page = (EVAL.parent / "docs/results/records/streaming_300/streaming.md").read_text()
    assert "| `all`: mhla-factorised [8x] − global-state [8x] | primary |" in page


def test_the_curves_draw_the_primary_check_first():
    """The page's curves follow the questions a run was asked: the colour run draws `colour` first, the
    runs of 2026-11-28 (primary `all`) keep the two panels they were drawn with."""
    assert report.curve_checks(report.QUESTIONS) == ("colour", "count", "all")
    assert report.curve_checks(report.QUESTIONS_2026_11_28) == ("all", "count")


def test_the_steady_step_time_leaves_the_first_steps_out():
    """The seconds a step takes between the first and the last log entries (what sizes a longer run), not
    the total over every step, whose first steps carry one-time costs."""
    log = [{"step": 25, "seconds": 30.0}, {"step": 50, "seconds": 32.5}, {"step": 100, "seconds": 37.5}]
    assert study.steady_step_time(log) == " (0.100 s a step after step 25)"
    assert study.steady_step_time(log[:1]) == ""
