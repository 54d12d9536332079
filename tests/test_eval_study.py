"""eval/study.py --smoke and the runner behind it (studies.experiments): arms x seeds trained, evaluated
along training, summarised with intervals and paired differences; resumable."""

import json
import math
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import studies.experiments as experiments
import yaml
from script_helpers import load_script
from studies.experiments import interval, paired

from mhla_gen.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def load_study():
    return load_script(ROOT / "eval" / "study.py", "eval_study")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    return out, load_study().main(["--smoke", "--out", str(out)])


def test_study_quick_arms_seeds_steps_and_files(quick):
    out, records = quick
    main = {(r["arm"], r["seed"], r["step"]) for r in records if r["group"] == "main"}
    assert main == {(a, s, t) for a in ("softmax", "linear", "mhla") for s in (0, 1) for t in (1, 2, 4)}
    ablations = {(r["arm"], r["step"]) for r in records if r["group"] == "ablation"}
    assert {a for a, _ in ablations} == {"mhla-uniform-init", "mhla-fixed-mixing", "mhla+cpe", "mhla+gate"}
    assert {t for _, t in ablations} == {4}  # ablations: the end of the budget only
    size = {r["arm"]: r["parameters"] for r in records}
    # identical size: MHLA adds only its M×M mixing matrix per layer (M = 1 for linear, 2×2 = 4 blocks here)
    assert size["linear"] - size["softmax"] == 1 and size["mhla"] - size["softmax"] == 16
    for r in records:  # a few training steps: far from the digits (real-vs-real digits FID is about 9)
        assert math.isfinite(r["fid_digits"]) and r["fid_digits"] > 20, r
    table = (out / "study.md").read_text()
    for arm in ("softmax", "linear", "mhla", "mhla+gate"):
        assert f"\n| {arm} | " in table
    assert "| mhla − softmax |" in table and "| mhla-fixed-mixing − mhla |" in table
    assert (out / "curves_smoke.png").stat().st_size > 0 and (out / "samples_smoke.png").stat().st_size > 0
    assert json.loads((out / "study.json").read_text())["records"] == records
    record = sys.modules["eval_results"].load(out / "record.npz")  # what the tables are rendered from
    assert record.points == records and record.meta["runner"] == "study"
    configs = {(c["arm"], tuple(c["seeds"])) for c in record.meta["configs"]}
    assert configs >= {(a, (0, 1)) for a in ("softmax", "linear", "mhla")}
    assert all("val" in arrays and "fid_draws" in arrays for arrays in record.arrays)


def test_a_study_folder_that_lost_its_marks_is_adopted(quick, tmp_path):
    """``mhla-gen adopt study`` accepts every file the runner writes today (record, reports, plots)."""
    from mhla_gen.commands.adopt import adopt
    from mhla_gen.outputs.folders import read_marker

    copy = tmp_path / "study"
    shutil.copytree(quick[0], copy, ignore=shutil.ignore_patterns(".*"))  # markers, listings, locks
    assert read_marker(copy) is None and (copy / "record.npz").is_file()
    adopt(copy, "study", show=lambda line: None)
    assert read_marker(copy)["kind"] == "study"


def test_study_resumes_only_what_is_missing(quick, monkeypatch):
    """A finished study is not re-run; a killed one redoes only its missing points (from checkpoints)."""
    out, records = quick
    calls = []
    original = experiments.train
    counting = lambda cfg, task: calls.append(cfg.output_dir) or original(cfg, task)
    monkeypatch.setattr(experiments, "train", counting)
    assert load_study().main(["--smoke", "--out", str(out)]) == records and calls == []
    (out / "smoke" / "results" / "mhla" / "seed1" / "step0000004.json").unlink()  # as if killed there
    again = load_study().main(["--smoke", "--out", str(out)])
    assert calls == [str(out / "smoke" / "runs" / "mhla" / "seed1")]
    before = next(r for r in records if (r["arm"], r["seed"], r["step"]) == ("mhla", 1, 4))
    after = next(r for r in again if (r["arm"], r["seed"], r["step"]) == ("mhla", 1, 4))
    assert after["fid_digits"] == before["fid_digits"]  # the same weights and samples as the first time


def test_study_report_only_reads_finished_runs(quick, monkeypatch, tmp_path):
    """--report-only trains nothing: a run with a missing point is left out of the tables, the
    ablations keep the seeds --ablation-seeds names, and a folder without finished runs is refused."""
    out, records = quick
    calls = []
    monkeypatch.setattr(experiments, "train", lambda cfg, task: calls.append(cfg.output_dir))
    missing = out / "smoke" / "results" / "mhla" / "seed1" / "step0000002.json"
    kept = missing.read_text()
    missing.unlink()  # mhla seed 1 is still running
    try:
        again = load_study().main(["--smoke", "--out", str(out), "--report-only", "--ablation-seeds", "1"])
    finally:
        missing.write_text(kept)
    assert calls == []
    assert {r["seed"] for r in again if r["arm"] == "mhla"} == {0}
    assert {r["seed"] for r in again if r["group"] == "ablation"} == {0}
    assert "\n| mhla | 1 | " in (out / "study.md").read_text()  # the seeds column
    with pytest.raises(ConfigError, match="no finished run"):
        load_study().main(["--smoke", "--out", str(tmp_path / "empty"), "--report-only"])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("user file")
    with pytest.raises(ConfigError, match="--out"):
        load_study().main(["--smoke", "--out", str(tmp_path / "mine"), "--report-only"])


def test_a_study_folder_refuses_other_settings_before_it_writes(quick, monkeypatch):
    """Points scored on other sample or triple counts, or runs trained with another setting, are not kept and
    reported under the new flags: refused, with or without --report-only, and nothing is written; a longer
    budget is not a change."""
    out, _ = quick
    before = {f: f.stat().st_mtime_ns for f in out.rglob("*")}
    for flags, said in ((["--fid-samples", "7"], "fid_samples (step 1): 20 -> 7"),
                        (["--val-triples", "16"], "val_triples (step 1): 32 -> 16")):
        for extra in ([], ["--report-only"]):
            with pytest.raises(ConfigError, match=re.escape(said)):
                load_study().main(["--smoke", "--out", str(out), *flags, *extra])
    assert {f: f.stat().st_mtime_ns for f in out.rglob("*")} == before
    study, planned = planning_study(monkeypatch)
    study.main(["--smoke", "--out", str(out)])
    job = next(j for j in planned if (j.arm, j.seed) == ("mhla", 0))
    assert experiments.changed_settings(job) == []
    assert experiments.changed_settings(replace(job, steps=[*job.steps, 8])) == []  # a longer budget
    other = replace(job, overrides=[*job.overrides, "train.learning_rate=0.5", "mhla.blocks=[1,1]"])
    assert experiments.changed_settings(other) == ["mhla.blocks: [2, 2] -> [1, 1]",
                                                   "train.learning_rate: 0.001 -> 0.5"]
    with pytest.raises(ConfigError, match="smoke/runs/mhla/seed0 was made with other settings"):
        experiments.check_settings(out, [other])
    for damaged, text in ((Path(job.result_dir) / "step0000001.json", "{not json"),
                          (Path(job.run_dir) / "config.yaml", "- a list\n- of lines\n")):
        kept = damaged.read_text()
        damaged.write_text(text)  # edited by hand: one line naming the file, not a traceback
        try:
            with pytest.raises(ConfigError, match=re.escape(damaged.name)):
                experiments.check_settings(out, [job])
        finally:
            damaged.write_text(kept)


def test_intervals_and_paired_differences():
    s = interval([1.0, 2.0, 3.0])
    assert (s["mean"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert s["ci"] == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)  # t(0.975, 2) * sd / sqrt(n)
    values = {"x": [5.0, 7.0, 4.0], "y": [6.0, 6.0, 6.0]}
    records = [{"arm": a, "seed": seed, "step": 10, "fid": v}
               for a in values for seed, v in enumerate(values[a])]
    p = paired(records, "x", "y", "fid", 10)
    assert p["per_seed"] == {0: -1.0, 1: 1.0, 2: -2.0} and p["negative"] == 2
    assert p["mean"] == pytest.approx(-2 / 3)


def test_arm_bands_tell_more_than_ten_arms_apart():
    """The colours repeat every 10 arms: arm 11 must differ from arm 1 in line style; each band in its
    line's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [{"arm": f"arm{i}", "seed": 0, "step": s} for i in range(12) for s in (0, 1)]
    stats = {(r["arm"], r["step"]): {"mean": 1.0, "ci": 0.1, "min": 0.9, "max": 1.1} for r in records}
    fig, ax = plt.subplots()
    experiments.plot_arm_bands(ax, stats, records, alpha=0.1)
    lines = ax.get_lines()
    looks = [(line.get_color(), line.get_linestyle(), line.get_marker()) for line in lines]
    assert len(lines) == 12 and len(set(looks)) == 12
    same = matplotlib.colors.same_color
    assert all(same(band.get_facecolor()[0][:3], matplotlib.colors.to_rgb(line.get_color()))
               for band, line in zip(ax.collections, lines, strict=True))
    plt.close(fig)


def test_every_arm_and_seed_is_scored_on_the_same_noise_and_triples(tmp_path):
    """Common random numbers: the evaluation of one model does not depend on the run's seed (samples,
    labels, validation triples), so paired differences between arms and seeds measure the models."""
    from studies.experiments import Job, evaluate_point

    from mhla_gen.train.config import DiTRunConfig, load_config
    from mhla_gen.train.dit import DiTTask

    study = load_study()
    grid = study.GRIDS["shapes-smoke"]
    cfg = load_config(DiTRunConfig, study.CONFIG, study.base_overrides(grid, study.grid_model(grid)))
    model = DiTTask(cfg).build_transformer().eval()
    scores = []
    for seed in (0, 1):
        job = Job("mhla", seed, study.CONFIG, [], [1], str(tmp_path / f"run{seed}"),
                  str(tmp_path / f"r{seed}"), fid_samples=20, val_triples=16)
        scores.append(evaluate_point(job, cfg, 1, model))
    for key in ("fid", "val_loss", "all_correct", "colour_accuracy", "symmetry_error"):
        assert scores[0][key] == scores[1][key], key
    assert scores[0]["data"] == "shapes" and math.isfinite(scores[0]["val_loss"])
    assert scores[0]["fid_bootstrap_sd"] > 0 and 0 <= scores[0]["all_correct"] <= 1


def test_study_on_the_shapes(tmp_path):
    records = load_study().main(["--smoke", "--data", "shapes", "--seeds", "1", "--no-ablations",
                                 "--out", str(tmp_path)])
    assert {(r["arm"], r["step"]) for r in records} == {(a, t) for a in ("softmax", "linear", "mhla")
                                                       for t in (1, 2, 4)}
    assert all(r["grid"] == "shapes-smoke" and r["tokens"] == 16 for r in records)
    table = (tmp_path / "study.md").read_text()
    assert "| all 4 properties ↑ |" in table and "| mhla − softmax | 1 |" in table
    assert "†" not in table and "‡" not in table  # the new scorer; every interval from per-sample scores
    assert "**too few seeds**" in table and "(primary)" in table
    buckets = table.split("Validation loss per timestep bucket")[1]  # every step, every bucket
    assert "| comparison | step | val_loss_b0 | val_loss_b1 | val_loss_b2 | val_loss_b3 |" in buckets
    assert all(f"| mhla − softmax | {t} | " in buckets for t in (1, 2, 4))
    assert (tmp_path / "shapes-smoke" / "results" / "mhla" / "seed0" / "step0000004_features.npz").is_file()
    for arm in ("softmax", "mhla"):  # the shapes' recipe reaches every arm's run (the digits keep theirs)
        run = yaml.safe_load((tmp_path / "shapes-smoke" / "runs" / arm / "seed0" / "config.yaml").read_text())
        assert run["train"]["learning_rate"] == 3e-3 and run["diffusion"]["snr_gamma"] == 5
        assert run["train"]["max_grad_norm"] == 1.0
    digits = load_study().base_overrides(load_study().GRIDS["256"], load_study().MODEL)
    assert not any(o.startswith(("train.learning_rate", "diffusion.snr_gamma", "train.max_grad_norm"))
                   for o in digits)
    with pytest.raises(ConfigError, match="--grids 64 is not a grid of --data shapes"):
        load_study().main(["--data", "shapes", "--grids", "64", "--out", str(tmp_path / "x")])
    as_if_old(tmp_path / "shapes-smoke" / "results")
    old = load_study().main(["--smoke", "--data", "shapes", "--seeds", "1", "--no-ablations", "--report-only",
                             "--out", str(tmp_path)])
    assert len(old) == len(records) and not any("shapes_scorer" in r for r in old)
    table = (tmp_path / "study.md").read_text()
    assert "† measured with the shapes scorer's version 1" in table  # re-rendered "as measured"
    assert "‡" in table  # the rates' shared-sample noise from the binomial bound: no per-sample scores


def as_if_old(results: Path) -> None:
    """Turn a study's result folder into records of the version before 2026-11-28: no scorer version, no
    shape rate, no per-sample scores beside the features and per-triple losses."""
    for path in results.rglob("step*.json"):
        if path.name.endswith("_features.npz"):
            continue
        record = json.loads(path.read_text())
        for key in ("shapes_scorer", "shape_accuracy"):
            record.pop(key, None)
        path.write_text(json.dumps(record))
    for path in results.rglob("step*_features.npz"):
        arrays = dict(np.load(path))
        np.savez(path, pool=arrays["pool"], val=arrays["val"])


def test_a_comparison_without_a_primary_metric_is_refused(tmp_path, monkeypatch):
    study, planned = planning_study(monkeypatch)
    monkeypatch.setitem(study.PRIMARY, "digits", None)
    with pytest.raises(ConfigError, match="primary metric"):
        study.main(["--smoke", "--out", str(tmp_path / "a")])
    assert planned == [] and not (tmp_path / "a").exists()


def planning_study(monkeypatch):
    """The study module with its runner and report replaced: ``main`` only plans, into the returned list."""
    study = load_study()
    planned = []
    monkeypatch.setattr(study, "study_records", lambda out, jobs, *a: planned.extend(jobs) or [])
    monkeypatch.setattr(study, "write_report", lambda *a: "")
    return study, planned


def test_arms_choose_and_order_the_main_arms(tmp_path, monkeypatch):
    study, planned = planning_study(monkeypatch)
    study.main(["--smoke", "--arms", "mhla", "softmax", "--no-ablations", "--out", str(tmp_path / "a")])
    assert [(j.arm, j.seed) for j in planned] == [("mhla", 0), ("mhla", 1), ("softmax", 0), ("softmax", 1)]
    for arms in (["bogus"], ["mhla", "mhla"]):
        with pytest.raises(ConfigError, match="--arms"):
            study.main(["--smoke", "--arms", *arms, "--out", str(tmp_path / "b")])
    assert not (tmp_path / "b").exists()


def test_ablations_choose_the_ablation_arms(tmp_path, monkeypatch):
    """--ablations runs the named ablations only; with an empty --arms, no main arm."""
    study, planned = planning_study(monkeypatch)
    study.main(["--smoke", "--arms", "--ablations", "mhla+gate", "mhla+cpe", "--seeds", "1",
                "--out", str(tmp_path / "a")])
    assert sorted(j.arm for j in planned) == ["mhla+cpe", "mhla+gate"]
    bad = (["--ablations", "bogus"], ["--ablations", "mhla+cpe", "mhla+cpe"], ["--arms", "--no-ablations"])
    for argv in bad:
        with pytest.raises(ConfigError, match="--arms|--ablations"):
            study.main(["--smoke", *argv, "--out", str(tmp_path / "b")])
    assert not (tmp_path / "b").exists()


def test_the_one_softmax_layer_arms_run_only_when_named(tmp_path, monkeypatch):
    """mhla+softmax@L keeps layer L as softmax (MHLA in the study model's other layers), is not among the
    default ablations, and is refused on a model too shallow to keep an MHLA layer."""
    study, planned = planning_study(monkeypatch)
    study.main(["--data", "shapes", "--grids", "256", "--arms", "--ablations", "mhla+softmax@0",
                "mhla+softmax@1", "--seeds", "1", "--no-throughput", "--out", str(tmp_path / "a")])
    layers = {j.arm: [o for o in j.overrides if o.startswith("mhla.layers")] for j in planned}
    assert layers == {"mhla+softmax@0": ["mhla.layers=[1,2,3]"], "mhla+softmax@1": ["mhla.layers=[0,2,3]"]}
    assert not [a for a in study.ABLATIONS if a.name.startswith("mhla+softmax")]
    with pytest.raises(ConfigError, match="at least one MHLA layer"):
        study.main(["--smoke", "--arms", "--ablations", "mhla+softmax@0", "--out", str(tmp_path / "b")])


def test_the_block_count_arms_run_only_when_named(tmp_path, monkeypatch):
    """mhla-blocksAxB overrides the grid's MHLA blocks (after them, so it wins), is not among the default
    ablations, and is refused before any work where the token grid is smaller than its blocks."""
    study, planned = planning_study(monkeypatch)
    study.main(["--data", "shapes", "--grids", "256", "--arms", "--ablations", "mhla-blocks8x8",
                "mhla-blocks16x16", "mhla-blocks8x16", "mhla-blocks16x8", "--seeds", "1", "--no-throughput",
                "--out", str(tmp_path / "a")])
    blocks = {j.arm: [o for o in j.overrides if o.startswith("mhla.blocks")][-1] for j in planned}
    assert blocks == {"mhla-blocks8x8": "mhla.blocks=[8,8]", "mhla-blocks16x16": "mhla.blocks=[16,16]",
                      "mhla-blocks8x16": "mhla.blocks=[8,16]", "mhla-blocks16x8": "mhla.blocks=[16,8]"}
    assert not [a for a in study.ABLATIONS if a.name.startswith("mhla-blocks")]
    with pytest.raises(ConfigError, match=r"\[8, 8\] blocks do not fit a 4x4"):
        study.main(["--smoke", "--arms", "--ablations", "mhla-blocks8x8", "--out", str(tmp_path / "b")])
    assert not (tmp_path / "b").exists()


def _record_pid(path):
    import os

    Path(path).write_text(str(os.getpid()))


def _die(path):
    import os

    os._exit(3)  # a worker killed mid-run (OOM killer, a segfault)


def test_parallel_runner_runs_each_job_in_a_fresh_process_and_stops_on_a_dead_worker(tmp_path):
    """experiments._map with 2 workers: every job runs (each in its own process on Python >= 3.11), and a
    worker that dies makes the study stop with an error instead of waiting forever (multiprocessing.Pool
    hung there)."""
    from concurrent.futures.process import BrokenProcessPool

    files = [tmp_path / f"job{i}" for i in range(2)]
    experiments._map(_record_pid, files, 2)
    pids = {f.read_text() for f in files}
    assert len(pids) == (2 if sys.version_info >= (3, 11) else len(pids))
    with pytest.raises(BrokenProcessPool):
        experiments._map(_die, files, 2)


def test_bucket_table_orders_buckets_by_number():
    """Ten or more buckets keep their numeric order (b2 before b10), each paired by seed."""
    buckets = [f"val_loss_b{k}" for k in range(11)]
    recs = [{"arm": arm, "seed": seed, "step": 8, **{b: 0.01 * (k + 1) + 0.001 * seed + (arm == "mhla") * 1e-3
                                                      for k, b in enumerate(buckets)}}
            for arm in ("mhla", "softmax") for seed in (0, 1, 2)]
    table = load_study().bucket_table(recs, ["softmax", "mhla"])
    assert "| comparison | step | " + " | ".join(buckets) + " |" in table
    assert table.count("| mhla − softmax | 8 | ") == 1


def test_checkpoint_every_sets_every_runs_checkpoints(tmp_path, monkeypatch):
    """--checkpoint-every reaches every run's config (a long run stopped between evaluation steps resumes
    from its newest checkpoint); without it, the evaluation steps' gcd; a non-positive value is refused."""
    study, planned = planning_study(monkeypatch)
    study.main(["--smoke", "--no-ablations", "--eval-steps", "2", "--checkpoint-every", "1",
                "--out", str(tmp_path / "a")])
    assert planned and {experiments.job_config(j, 4).train.checkpoint_every for j in planned} == {1}
    planned.clear()
    study.main(["--smoke", "--no-ablations", "--eval-steps", "2", "--out", str(tmp_path / "a")])
    assert {experiments.job_config(j, 4).train.checkpoint_every for j in planned} == {2}
    with pytest.raises(ConfigError, match="--checkpoint-every must be positive, got 0"):
        study.main(["--smoke", "--checkpoint-every", "0", "--out", str(tmp_path / "b")])
    assert not (tmp_path / "b").exists()


def test_runs_of_one_seed_run_side_by_side(tmp_path, monkeypatch):
    """The runner takes the runs seed by seed (every arm of seed 0 before seed 1), so a study stopped
    early holds paired runs; the plan itself stays arm by arm."""
    study, jobs = planning_study(monkeypatch)
    study.main(["--smoke", "--no-ablations", "--out", str(tmp_path / "a")])
    ran = []

    def record_order(fn, todo, workers):
        if fn is experiments.run_job:  # (the first call runs the stage-1 runs: none here)
            ran.extend(todo)
            raise KeyboardInterrupt  # stop before the runner reads the results

    monkeypatch.setattr(experiments, "_map", record_order)
    with pytest.raises(KeyboardInterrupt):
        experiments.run_jobs(tmp_path / "a", "study", "--out", jobs, 2)
    assert [(j.arm, j.seed) for j in jobs][:2] == [("softmax", 0), ("softmax", 1)]
    assert [(j.arm, j.seed) for j in ran] == sorted(((j.arm, j.seed) for j in jobs), key=lambda p: p[1])


def other_runners_folder(folder: Path, runner: str, in_marker: bool) -> dict[Path, bytes]:
    """A study folder of ``eval/<runner>.py``: its marker naming the runner (``in_marker``) or, as folders
    marked before 2026-11-29, only its ``record.npz`` does; returns its files' bytes."""
    from mhla_gen.outputs.folders import write_marker

    results = load_study().results
    folder.mkdir()
    write_marker(folder, "study", **({"runner": runner} if in_marker else {}))
    results.save(results.make_record(runner, f"python eval/{runner}.py", [], [], {}), folder / "record.npz")
    (folder / "report.md").write_text("its report\n")
    return {p: p.read_bytes() for p in folder.rglob("*")}


@pytest.mark.parametrize("script, argv, theirs", [
    ("study", ["--smoke"], "stream_study"), ("study", ["--smoke", "--report-only"], "adaptation"),
    ("adaptation", ["--smoke"], "study"), ("scale_study", ["--smoke"], "study"),
    ("stream_study", ["--size", "smoke"], "study")])
@pytest.mark.parametrize("in_marker", [True, False])
def test_a_study_folder_of_another_runner_is_refused_before_it_writes(tmp_path, script, argv, theirs,
                                                                      in_marker):
    out = tmp_path / "theirs"
    before = other_runners_folder(out, theirs, in_marker)
    runner = load_script(ROOT / "eval" / f"{script}.py", f"eval_{script}")
    with pytest.raises(ConfigError, match=f"is a study folder of eval/{theirs}.py, not of eval/{script}.py"):
        runner.main([*argv, "--out", str(out)])
    assert {p: p.read_bytes() for p in out.rglob("*")} == before


@pytest.mark.parametrize("argv, line", [
    (["--seeds", "2", "--ablation-seeds", "3"], "--ablation-seeds 3 is more than this call's 2 seeds"),
    (["--smoke", "--ablation-seeds", "3"], "--ablation-seeds 3 is more than this call's 2 seeds"),
    (["--smoke", "--fid-samples", "1"], "--fid-samples must be at least 2, got 1"),
    (["--smoke", "--val-triples", "30"], "--val-triples must be a multiple of 4 .* got 30")])
def test_contradictory_counts_are_refused_before_the_folder_is_made(tmp_path, monkeypatch, argv, line):
    study = load_study()
    monkeypatch.setattr(study, "plan", lambda args: pytest.fail("planned (and trained) a refused call"))
    with pytest.raises(ConfigError, match=line):
        study.main([*argv, "--out", str(tmp_path / "a")])
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("argv", [["--quick", "--seeds", "3", "--ablation-seeds", "3"],
                                  ["--seeds", "2", "--ablation-seeds", "3", "--no-ablations"]])
def test_ablation_seeds_are_not_checked_where_no_ablation_runs(tmp_path, monkeypatch, argv):
    """--quick and --no-ablations run no ablation arm: a launch line's --ablation-seeds (above --quick's 2
    seeds, or above --seeds) is then no contradiction, and the call goes on to plan its runs."""
    study = load_study()

    class Planned(Exception):
        pass

    def plan(args):
        raise Planned

    monkeypatch.setattr(study, "plan", plan)
    with pytest.raises(Planned):
        study.main([*argv, "--out", str(tmp_path / "a")])
