"""eval/scale_study.py at smoke size on the CPU: its budgets (equal images, equal compute), its runs and
evaluation points, its exported records and the tables they render again, its sizing file, and the
refusals before any work."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from script_helpers import load_script
from studies import scale_preset as preset
from studies import scale_report, scale_sizing

from mhla_gen.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def load_study():
    return load_script(ROOT / "eval" / "scale_study.py", "eval_scale_study")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    records = load_study().main(["--smoke", "--out", str(out / "runs"), "--export", str(out / "rec")])
    return out, records


def test_smoke_runs_every_arm_to_its_points_and_writes_its_record(smoke, tmp_path):
    out, records = smoke
    study = load_study()
    assert {(r["arm"], r["step"]) for r in records} == {(a, s) for a in ("softmax", "mhla", "linear")
                                                       for s in (4, 8)}
    for r in records:  # samples at the two end points only (here both at step 8); the loss everywhere
        assert math.isfinite(r["val_loss"]) and r["images_steps"] == [4, 8]
        assert math.isfinite(r["fid"]) == (r["step"] == 8), r
        assert r["flops_per_image"] > 0 and r["batch"] == study.GRIDS["smoke"]["batch"]
        assert r["train_flops"] == r["step"] * r["batch"] * r["flops_per_image"]
    record = study.results.load(out / "rec" / "record.npz")
    assert record.points == records and record.meta["runner"] == "scale_study"
    assert record.meta["mhla_backend"] == "pytorch" and record.meta["device"] == "cpu"
    assert record.meta["precision"] == "bf16"  # the GPU run's autocast, on the CPU
    assert record.meta["plans"]["smoke"]["images"] == 32 and len(record.meta["configs"]) == 3
    samples = record.samples()
    assert set(samples.arrays(next(r for r in records if r["step"] == 8))) >= {"val", "all", "fid_draws"}
    assert set(samples.arrays(next(r for r in records if r["step"] == 4))) == {"val"}
    md = (out / "rec" / "scale_study.md").read_text()
    assert md == (out / "runs" / "scale_study.md").read_text()  # --out and --export: the same report
    assert md.startswith(study.REPORT_MARK) and "| mhla − softmax | equal compute | 1 |" in md
    assert "(primary)" in md.split("| mhla − softmax | equal compute |")[1].split("\n")[0]
    # the tables again, from the record alone (the one command that regenerates every table)
    written = study.results.render(record, tmp_path / "again")
    assert [p.name for p in written] == ["scale_study.md"] and written[0].read_text() == md
    assert (out / "rec" / "record.npz").stat().st_size < 200_000
    # committable as every study's record: added to a records folder, it regenerates byte for byte
    added = study.results.add(out / "rec", "scale-smoke", tmp_path / "records")
    assert added == ["scale-smoke/scale_study.md"]
    assert study.results.regenerate(tmp_path / "records", check=True) == []


def test_the_budget_matches_compute_across_arms(monkeypatch):
    """Equal images: every arm at the reference's steps. Equal compute: an arm whose training image costs
    a third of softmax's trains three times the steps; --compute time uses measured images/s instead;
    --seconds turns the sizing into the reference's images (every arm's runs added)."""
    study = load_study()
    costs = {"softmax": 3e9, "mhla": 1e9, "linear": 1e9}
    monkeypatch.setattr(preset, "train_flops_per_image",
                        lambda cfg: {"train": costs[cfg.model.attention], "forward": 0.0})
    args = study.parse_args(["--images", "1024", "--grids", "1024", "--device", "cpu"])
    plan = study.grid_plan("1024", args, None)
    assert plan["images_steps"] == [4, 8, 16, 32] and plan["images"] == 1024  # batch 32
    assert plan["compute_steps"] == {"softmax": [4, 8, 16, 32], "mhla": [12, 24, 48, 96],
                                     "linear": [12, 24, 48, 96]}
    speed = {("1024", "softmax"): 100.0, ("1024", "mhla"): 200.0, ("1024", "linear"): 400.0}
    args.compute = "time"
    assert study.grid_plan("1024", args, speed)["compute_steps"]["linear"] == [16, 32, 64, 128]
    args.compute, args.images, args.seconds = "flops", None, 120.0
    # per reference image: 3 seeds x (1/100 + 3/200 + 3/400) s = 0.0975 s -> 1230 images -> 1024 (a unit
    # of 32 x 8 images); evaluations at 1e9 forward images/s: none to speak of
    fast = {key: 1e9 for key in speed}
    assert study.grid_plan("1024", args, speed, fast)["images"] == 1024
    # at 1000 forward images/s every arm: 3 seeds x ((4 + 8 + 8) points x 1024 triples + 3 x 4000 sampling
    # forwards) / 1000 = 97.44 s of evaluations, 22.56 s left: 231 images, fewer than a unit of 256
    slow = {key: 1000.0 for key in speed}
    with pytest.raises(ValueError, match=r"120 s leave 23 s of training after the evaluations \(97 s\)"):
        study.grid_plan("1024", args, speed, slow)
    args.seconds = 220.0  # 122.56 s of training: 1257 images -> 1024
    planned = study.grid_plan("1024", args, speed, slow)
    assert planned["images"] == 1024 and planned["eval_seconds"] == pytest.approx(97.44)
    jobs = study.plan_jobs(argparse_out(args), {"1024": plan})["1024"]
    mhla = [j for j in jobs if j.arm == "mhla"]
    assert len(mhla) == 3 and mhla[0].steps == [4, 8, 12, 16, 24, 32, 48, 96]
    assert mhla[0].sample_at == [32, 96] and mhla[0].checkpoint_every == 96
    assert not mhla[0].attention_stats and "train.learning_rate=1e-3" in mhla[0].overrides


def argparse_out(args):
    args.out = Path("/nonexistent/scale")  # planned only: nothing is written
    return args


def test_equal_compute_records_are_labelled_with_the_reference_step():
    recs = [{"arm": "mhla", "seed": 0, "step": s, "images_steps": [4, 8], "compute_steps": [12, 24]}
            for s in (4, 8, 12, 24)]
    assert [(r["step"], r["result_step"]) for r in scale_report.at_compute(recs)] == [(4, 12), (8, 24)]
    assert [r["step"] for r in scale_report.at_images(recs)] == [4, 8]


def test_refusals_before_any_work(tmp_path):
    study = load_study()
    with pytest.raises(ConfigError, match="give a budget"):
        study.parse_args(["--device", "cpu"])
    with pytest.raises(ConfigError, match="give --sizing"):
        study.parse_args(["--device", "cpu", "--seconds", "60"])
    with pytest.raises(ConfigError, match="no CUDA device"):
        study.parse_args(["--images", "64"])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "scale_study.md").write_text("my notes\n")
    with pytest.raises(ConfigError, match="not written by this script"):
        study.parse_args(["--smoke", "--export", str(tmp_path / "mine")])
    assert (tmp_path / "mine" / "scale_study.md").read_text() == "my notes\n"
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "record.npz").write_bytes(b"their data")
    with pytest.raises(ConfigError, match="not a record of ours"):
        study.parse_args(["--smoke", "--export", str(tmp_path / "theirs")])
    (tmp_path / "study").mkdir()  # another study's record: it stays
    record = study.results.make_record("study", "python eval/study.py", [], [], {})
    study.results.save(record, tmp_path / "study" / "record.npz")
    kept = (tmp_path / "study" / "record.npz").read_bytes()
    with pytest.raises(ConfigError, match="a record of eval/study.py, not of this script"):
        study.parse_args(["--smoke", "--export", str(tmp_path / "study")])
    assert (tmp_path / "study" / "record.npz").read_bytes() == kept
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        study.parse_args(["--smoke", "--export", str(tmp_path / "file")])
    for argv, line in ((["--first-seed", "-1"], "--first-seed must be >= 0, got -1"),
                       (["--jobs", "0"], "--jobs must be positive, got 0"),
                       (["--seconds", "0", "--sizing", "x.json"], "--seconds must be positive, got 0")):
        with pytest.raises(ConfigError, match=line):
            study.parse_args(["--smoke", *argv])
    for name, text in (("notes.txt", "my notes\n"), ("list.json", "[1, 2]\n")):  # a user's files, kept
        (tmp_path / name).write_text(text)
        for argv in (["--sizing-only"], ["--out", str(tmp_path / "runs")]):
            with pytest.raises(ConfigError, match=f"--sizing '.*{name}' is not a sizing file"):
                study.main(["--smoke", "--sizing", str(tmp_path / name), *argv])
        assert (tmp_path / name).read_text() == text and not (tmp_path / "runs").exists()


def test_a_cuda_run_is_refused_off_gpu_0_or_without_triton(monkeypatch):
    """The runs train on GPU 0 (Accelerate's), and the MHLA arms on CUDA are the Triton kernels': another
    GPU index, or CUDA without Triton (the op would run PyTorch without a word), is refused before work."""
    import torch

    study = load_study()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(study, "triton_importable", lambda: True)
    with pytest.raises(ConfigError, match="--device cuda:1: .*CUDA_VISIBLE_DEVICES=1 and --device cuda"):
        study.parse_args(["--device", "cuda:1", "--images", "64"])
    assert study.parse_args(["--device", "cuda:0", "--images", "64"]).precision == "bf16"
    monkeypatch.setattr(study, "triton_importable", lambda: False)
    with pytest.raises(ConfigError, match="--device cuda: .*Triton kernels on CUDA, and triton does not"):
        study.parse_args(["--images", "64"])


def test_a_run_is_evaluated_in_the_precision_it_trained_in():
    """The evaluation autocasts as Accelerate trained the run (train.mixed_precision) on the job's device,
    the CPU included (the smoke trains in bf16 there); a run trained in fp32 is evaluated in fp32."""
    from types import SimpleNamespace

    import torch
    from studies.experiments import _autocast

    for device in ("cpu", "cuda"):
        job = SimpleNamespace(device=device)
        for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("no", None)):
            cfg = SimpleNamespace(train=SimpleNamespace(mixed_precision=precision))
            context = _autocast(job, cfg)
            assert getattr(context, "fast_dtype", None) == dtype
            assert getattr(context, "device", device) == device


def test_runs_that_evaluate_on_the_cpu_train_there(monkeypatch):
    """Accelerate trains on a GPU wherever there is one: the runs of a CPU study get ACCELERATE_USE_CPU
    (inherited by their processes), and the setting is as before once they are done."""
    import os

    study = load_study()
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    with study.training_on("cpu"):
        assert os.environ["ACCELERATE_USE_CPU"] == "true"
    assert "ACCELERATE_USE_CPU" not in os.environ
    with study.training_on("cuda"):
        assert "ACCELERATE_USE_CPU" not in os.environ
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")
    with study.training_on("cpu"):
        assert os.environ["ACCELERATE_USE_CPU"] == "true"
    assert os.environ["ACCELERATE_USE_CPU"] == "false"
    # runs on CUDA: the allocator's expandable segments (nine processes share the GPU), a user's kept
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with study.training_on("cuda"):
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    with study.training_on("cpu"):
        assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    with study.training_on("cuda"):
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"


def test_sizing_file_is_written_and_checked(tmp_path):
    study = load_study()
    path = tmp_path / "sizing.json"
    study.main(["--smoke", "--sizing-only", "--sizing", str(path), "--sizing-seconds", "0"])
    measured = json.loads(path.read_text())
    assert [r["arm"] for r in measured["rows"]] == ["softmax", "mhla", "linear"]
    assert all(r["images_per_s"] > 0 and r["flops_per_image"] > 0 for r in measured["rows"])
    infer = study.read_sizing(path, ["smoke"], "infer_images_per_s")
    assert all(v > 0 for v in infer.values()) and infer[("smoke", "mhla")] == measured["rows"][1][
        "infer_images_per_s"]
    older = {**measured, "rows": [{k: v for k, v in r.items() if k != "infer_images_per_s"}
                                  for r in measured["rows"]]}
    (tmp_path / "older.json").write_text(json.dumps(older))
    with pytest.raises(ConfigError, match="has no infer_images_per_s \\(an older file\\): measure again"):
        study.read_sizing(tmp_path / "older.json", ["smoke"], "infer_images_per_s")
    speed = study.read_sizing(path, ["smoke"])
    assert speed[("smoke", "mhla")] == measured["rows"][1]["images_per_s"]
    with pytest.raises(ConfigError, match="measured grid 1024 with model None"):
        study.read_sizing(path, ["1024"])
    measured["rows"][0]["batch"] = 99
    path.write_text(json.dumps(measured))
    with pytest.raises(ConfigError, match="no softmax row at grid smoke with batch"):
        study.read_sizing(path, ["smoke"])
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a sizing file"):
        study.main(["--smoke", "--sizing-only", "--sizing", str(tmp_path / "other.json")])
    assert np.isfinite(speed[("smoke", "softmax")])


def test_the_sizing_file_is_written_after_every_row(tmp_path, monkeypatch):
    """A row that fails (an out-of-memory, a kernel error) leaves the rows measured before it in the file;
    a study given that file says which grid it cannot size, and runs nothing of it."""
    study = load_study()
    real, calls = scale_sizing.measure_training, []

    def measure_training(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the third arm
            raise RuntimeError("CUDA out of memory (a test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(scale_sizing, "measure_training", measure_training)
    path = tmp_path / "sizing.json"
    with pytest.raises(RuntimeError, match="out of memory"):
        study.main(["--smoke", "--sizing-only", "--sizing", str(path), "--sizing-seconds", "0"])
    assert [r["arm"] for r in json.loads(path.read_text())["rows"]] == ["softmax", "mhla"]
    with pytest.raises(ConfigError, match=r"no grid can run: grid smoke: --sizing .* has no linear row"):
        study.main(["--smoke", "--sizing", str(path), "--out", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists()


def test_log_points_and_equal_compute_steps():
    assert preset.log_points(64, 4) == [8, 16, 32, 64]
    assert preset.log_points(3, 4) == [1, 3]  # a short budget: the duplicates dropped
    with pytest.raises(ValueError):
        preset.log_points(0, 2)
    # an arm at 1/1.57 of the reference's cost per step spends the reference's compute at 1.57x the steps
    assert preset.equal_compute_steps([8, 16, 32, 64], 1.57, 1) == [13, 25, 50, 100]
    assert preset.equal_compute_steps([8, 16, 32, 64], 1.57, 4) == [12, 24, 52, 100]  # multiples of the unit
    assert preset.equal_compute_steps([8], 0.01, 4) == [4]  # at least one unit
    with pytest.raises(ValueError):
        preset.equal_compute_steps([8], 0.0, 1)


def test_images_for_seconds_adds_every_run_of_every_arm():
    # reference 100 images/s; an arm training 2x the images at 400 images/s: per reference image and
    # seed 1/100 + 2/400 = 0.015 s, 3 seeds: 0.045 s -> 90 s hold 2000 images
    cost = {"softmax": (1.0, 100.0), "mhla": (2.0, 400.0)}
    assert preset.images_for_seconds(90, 3, cost) == 2000
    assert preset.images_for_seconds(90, 3, cost, multiple=256) == 1792
    with pytest.raises(ValueError, match="fewer than one budget unit"):
        preset.images_for_seconds(1, 3, cost, multiple=256)
    assert preset.images_for_seconds(135, 3, cost, evaluations=45) == 2000  # the evaluations come first
    with pytest.raises(ValueError, match="do not cover the runs' evaluations alone"):
        preset.images_for_seconds(45, 3, cost, evaluations=45)


def test_eval_seconds_counts_every_runs_validation_and_sampling():
    """Per run: the validation loss's triples at each point (the reference's points, twice that for the
    others) and two end points' sampling (samples x steps, doubled by guidance), at the arm's forward
    speed; every seed."""
    grid = {"fid_samples": 100, "sample_steps": 10}
    # softmax: 4 x 1024 + 4000 = 8096 forwards at 100/s; mhla: 8 x 1024 + 4000 = 12192 at 200/s
    seconds = preset.eval_seconds(grid, 4, 3, {"softmax": 100.0, "mhla": 200.0})
    assert seconds == pytest.approx(3 * (8096 / 100 + 12192 / 200))
    assert preset.eval_seconds({**grid, "val_triples": 32}, 2, 1, {"softmax": 1.0}) == 2 * 32 + 4000


def test_measure_training_trains_the_model_it_times():
    import torch

    from mhla_gen.train.dit import DiTTask

    config = preset.arm_config(preset.GRIDS["smoke"], preset.ARMS[1])
    model = DiTTask(config).build_transformer()
    before = [p.detach().clone() for p in model.parameters()]
    speed = scale_sizing.measure_training(lambda: model, batch=2, resolution=32, channels=3, device="cpu",
                                          dtype=torch.bfloat16, seconds=0.0, warmup=1)
    assert speed["steps"] >= 3 and speed["images_per_s"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # AdamW stepped


def test_a_failed_run_keeps_every_point_finished_before_it(tmp_path, monkeypatch):
    """One run of a grid raising mid-run (an out-of-memory on the GPU, or the time limit's Ctrl-C) stops
    the study with its error, but the record and report of every point finished by then are written
    first (--out and --export): the other runs' and the first point of the run cut short."""
    from studies import experiments

    real = experiments.train

    def train(cfg, task):  # the linear run trains to its first point (step 4), then fails
        if cfg.model.attention == "linear" and cfg.train.max_steps > 4:
            raise RuntimeError("CUDA out of memory (a test)")
        return real(cfg, task)

    monkeypatch.setattr(experiments, "train", train)
    out = tmp_path / "s"
    with pytest.raises(RuntimeError, match="out of memory"):
        load_study().main(["--smoke", "--jobs", "1", "--out", str(out / "runs"), "--export",
                           str(out / "rec")])
    study = load_study()
    record = study.results.load(out / "rec" / "record.npz")
    assert {(p["arm"], p["step"]) for p in record.points} == {
        ("softmax", 4), ("softmax", 8), ("mhla", 4), ("mhla", 8), ("linear", 4)}
    assert record.meta["stopped"] == "grid smoke"
    md = (out / "rec" / "scale_study.md").read_text()
    assert md.startswith(study.REPORT_MARK) and "Stopped early (a run failed or the time ran out) in grid " \
        "smoke" in md
    assert "| linear | 4 | 16 |" in md  # the run cut short: its finished point is in the curve


def sizing_file(path: Path, infer: dict[str, float], grids=("1024", "4096")) -> Path:
    """A sizing file of this preset's model and batches: 100 training images/s every arm, forward
    ``infer[grid]`` images/s."""
    rows = [{"grid": g, "arm": a.name, "batch": preset.GRIDS[g]["batch"], "images_per_s": 100.0,
             "infer_images_per_s": infer[g]} for g in grids for a in preset.ARMS]
    path.write_text(json.dumps({"format": scale_sizing.SIZING_FORMAT, "rows": rows,
                                "model": {g: preset.grid_model(preset.GRIDS[g]) for g in ("1024", "4096")}}))
    return path


def test_each_grid_is_planned_on_its_own(tmp_path, monkeypatch):
    """A grid that cannot be planned (its evaluations alone past --seconds, or no sizing rows of its own)
    is left out with its reason, and the other grid runs; with none left the command refuses, naming
    each grid's reason. The 4096-token grid (the study's point) runs first by default."""
    study = load_study()
    monkeypatch.setattr(preset, "train_flops_per_image", lambda cfg: {"train": 1e9, "forward": 0.0})
    path = sizing_file(tmp_path / "sizing.json", {"1024": 1e9, "4096": 100.0})
    args = study.parse_args(["--seconds", "120", "--sizing", str(path), "--device", "cpu"])
    assert args.grids == ["4096", "1024"]
    plans, skipped = study.plan_grids(args)
    assert list(plans) == ["1024"] and list(skipped) == ["4096"]
    assert "do not cover the runs' evaluations alone" in skipped["4096"]
    lines = study.status_lines({"skipped": skipped})
    assert lines.strip().startswith("Grid 4096 was not run: 120 s do not cover")
    sizing_file(path, {"1024": 1e9, "4096": 1e9}, grids=("4096",))  # the 1024 rows missing
    plans, skipped = study.plan_grids(args)
    assert list(plans) == ["4096"] and "has no softmax row at grid 1024" in skipped["1024"]
    sizing_file(path, {"1024": 100.0, "4096": 100.0})
    with pytest.raises(ConfigError, match="no grid can run: grid 4096: .*evaluations alone.*; grid 1024: "):
        study.plan_grids(args)
    assert study.status_lines({}) == ""


def test_the_cost_table_says_the_runs_share_the_device():
    """The runs' training images/s are each a share of one device (every run of a grid at once); the
    sizing's speed of the model alone stands beside them."""
    recs = [{"arm": a, "seed": 0, "step": 8, "flops_per_image": 1e9, "images_steps": [4, 8],
             "compute_steps": [4, 8], "train_images_per_s": 50.0} for a in ("softmax", "mhla")]
    sizing = {"rows": [{"grid": "1024", "arm": "softmax", "images_per_s": 400.0},
                       {"grid": "4096", "arm": "softmax", "images_per_s": 100.0}]}
    table = scale_report.cost_table(recs, scale_report.sizing_speeds(sizing, "1024"), 9)
    assert "training images/s (the runs, median; 9 runs sharing the device)" in table
    assert "| training images/s (sizing: one run alone) |" in table
    assert table.splitlines()[2].endswith("| 50 | 400 |") and table.splitlines()[3].endswith("| 50 | — |")
