"""eval/adaptation.py --smoke: teachers trained, conversion arms (plain, stage 1 + distillation, hybrid,
from a linear teacher) run on the shared runner and evaluated from step 0 on; resumable."""

import json
from pathlib import Path

import pytest
import studies.experiments as experiments
from script_helpers import load_script

from mhla_gen.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def load_adaptation():
    return load_script(ROOT / "eval" / "adaptation.py", "eval_adaptation")


def test_adaptation_quick(tmp_path, monkeypatch):
    module = load_adaptation()
    records = module.main(["--smoke", "--out", str(tmp_path)])
    expected = {(a, s) for a in module.SMOKE_ARMS for s in (0, 1, 2, 4)}
    assert {(r["arm"], r["step"]) for r in records} == expected
    stage1 = {r["arm"]: r["stage1"] for r in records if "stage1" in r}
    assert set(stage1) == {"mhla-stage1-distill", "hybrid-auto"}
    assert len(stage1["hybrid-auto"]["softmax_layers"]) == 1
    assert stage1["mhla-stage1-distill"]["softmax_layers"] == []
    assert all(s["teacher_forward_equivalents"] > 0 for s in stage1.values())
    at0 = {r["arm"]: r["fid_digits"] for r in records if r["step"] == 0}
    assert at0["softmax-continued"] > 0 and all(v > 0 for v in at0.values())
    blocks = (tmp_path / "adaptation.md").read_text().split("\n\n")  # the FID table, then val loss, decisions
    fid_table = "\n" + next(b for b in blocks if b.startswith("| arm | seeds |"))
    assert fid_table.count("\n| ") == 1 + len(module.SMOKE_ARMS)
    assert (tmp_path / "curves_smoke.png").stat().st_size > 0
    assert json.loads((tmp_path / "adaptation.json").read_text())["records"] == records

    calls = []
    monkeypatch.setattr(experiments, "train", lambda cfg, task: calls.append(cfg.output_dir))
    assert module.main(["--smoke", "--out", str(tmp_path)]) == records and calls == []  # nothing redone
    assert module.main(["--smoke", "--out", str(tmp_path), "--report-only"]) == records and calls == []


def fake_study(module, root: Path, seeds=(0,), attention="softmax", grid="smoke", budgets=None,
               weights=False, **model) -> Path:
    """A finished eval/study.py folder's ``attention`` teachers of ``grid``: each run's ``config.yaml`` (its
    record; ``budgets``: each one's train.max_steps, ``model``: changed model settings) and ``final/``
    (``weights``: an untrained model saved as a run saves it, else empty). Trains nothing."""
    from mhla_gen.outputs.folders import write_marker
    from mhla_gen.train.config import config_to_yaml
    from mhla_gen.train.dit import DiTTask

    settings = module.GRIDS[grid]
    for i, seed in enumerate(seeds):
        budget = dict(settings, teacher_steps=budgets[i] if budgets else settings["teacher_steps"])
        cfg = module.teacher_config(root, grid, attention, budget, dict(module.grid_model(settings), **model),
                                    seed)
        run = root / grid / "runs" / attention / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(config_to_yaml(cfg))
        (run / "final").mkdir()
        if weights:
            task = DiTTask(cfg)
            task.save_final(task.build_transformer(), run / "final")
            write_marker(run / "final", "model", **task.model_record())
    return root


def test_three_teachers_end_to_end(tmp_path, monkeypatch):
    """--teachers-from a study of three teachers (two budgets) and --seeds 3: seed k's conversion starts
    from teacher k, and its records carry that teacher and its training FLOPs (step 0 alone: the converted
    teachers evaluated, nothing trained, a few seconds)."""
    from studies.teachers import training_flops

    from mhla_gen.train.config import DiTRunConfig, load_config

    module = load_adaptation()
    study = fake_study(module, tmp_path / "study", seeds=(0, 1, 2), budgets=(4, 4, 8), weights=True)
    monkeypatch.setattr(module, "eval_steps", lambda steps: [0])
    import functools

    import studies.evidence as evidence  # FIDs of 2 resamples, not 50: the FID is not what this tests

    monkeypatch.setattr(evidence, "fid_bootstrap", functools.partial(evidence.fid_bootstrap, draws=2))
    monkeypatch.setattr(evidence, "FID_DRAWS", 2)
    records = module.main(["--smoke", "--arms", "mhla-plain", "--seeds", "3", "--teachers-from", str(study),
                           "--out", str(tmp_path / "out")])
    assert sorted((r["seed"], r["step"]) for r in records) == [(0, 0), (1, 0), (2, 0)]
    for r in records:
        run = study / "smoke" / "runs" / "softmax" / f"seed{r['seed']}"
        assert r["teacher"] == str(run.resolve()) and r["teacher_steps"] == (4, 4, 8)[r["seed"]]
        assert r["teacher_flops"] == training_flops(load_config(DiTRunConfig, run / "config.yaml"))
        assert module.compute(r) == r["teacher_flops"] and module.compute(r, sunk_teacher=True) == 0
    report = (tmp_path / "out" / "adaptation.md").read_text()
    assert "; 3 teachers (seed k's runs start from teacher k)" in report


@pytest.mark.parametrize("argv, line", [
    (["--seeds", "0"], "--seeds must be >= 1, got 0"),
    (["--smoke", "--seeds", "0"], "--seeds must be >= 1, got 0"),
    (["--smoke", "--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["--steps", "5"], "--steps must be >= 8, got 5")])
def test_bad_counts_are_refused_naming_the_value(tmp_path, monkeypatch, argv, line):
    """Zero counts are refused as given, not replaced by the default (or --smoke's) before the check."""
    adaptation = load_adaptation()
    monkeypatch.setattr(adaptation, "plan", lambda args: pytest.fail("planned (and trained) a refused call"))
    with pytest.raises(ConfigError, match=line):
        adaptation.main([*argv, "--out", str(tmp_path / "a")])
    assert not (tmp_path / "a").exists()


def test_adaptation_refuses_a_missing_study(tmp_path):
    from mhla_gen.errors import ConfigError

    with pytest.raises(ConfigError, match="run eval/study.py first"):
        load_adaptation().main(["--smoke", "--out", str(tmp_path / "a"), "--teachers-from", str(tmp_path)])


def test_stage1_runs_are_found_however_the_paths_are_spelled(tmp_path, monkeypatch):
    """A relative --out / --teachers-from names the same stage-1 runs and teachers as the absolute one
    (a resumed study must not redo stage 1 because the shell's spelling changed)."""
    import argparse

    module = load_adaptation()
    fake_study(module, tmp_path / "study")
    monkeypatch.chdir(tmp_path)

    def planned(root):
        args = argparse.Namespace(grids=["smoke"], steps=None, softmax_layers=False, seeds=1,
                                  arms=["mhla-stage1"], out=root / "out", scratch=False,
                                  report_only=False, teachers_from=[root / "study"])
        (job,) = module.plan(args)
        return Path(job.stage1_dir).resolve(), [o for o in job.stage1 if "init_from" in o]

    assert planned(Path(".")) == planned(tmp_path)


def test_only_the_teachers_the_arms_start_from_are_needed(tmp_path):
    """Arms that start from the softmax teacher need no linear teacher (none is trained or looked up);
    an arm from the linear teacher still refuses a study without one."""
    import argparse

    from mhla_gen.errors import ConfigError

    module = load_adaptation()
    study = fake_study(module, tmp_path / "study")
    args = argparse.Namespace(grids=["smoke"], steps=None, softmax_layers=False, seeds=1,
                              arms=["mhla-plain", "mhla-stage1"], out=tmp_path / "out", scratch=False,
                              report_only=False, teachers_from=[study])
    jobs = module.plan(args)
    assert [j.arm for j in jobs] == ["mhla-plain", "mhla-stage1"]
    starts = " ".join(o for j in jobs for o in (*j.overrides, *(j.stage1 or ())) if "init_from" in o)
    assert str(study / "smoke" / "runs" / "softmax" / "seed0" / "final") in starts and "@" not in starts
    args.arms = ["mhla-plain", "linear-continued"]
    with pytest.raises(ConfigError, match="linear"):
        module.plan(args)
    args.arms = ["softmax1-fixed"]  # one arm of the softmax-layer sweep, without the rest of it
    module.check_arms(args)
    (job,) = module.plan(args)
    assert job.arm == "softmax1-fixed"
    assert job.stage1[-3:-1] == ["transfer.trainable=all", "hybrid.softmax_layers=[0]"]
    args.arms, args.grids = None, ["64"]  # every arm of the grid, but the sweep only with --softmax-layers
    for name in ("softmax", "linear"):
        fake_study(module, study, attention=name, grid="64")
    planned = {j.arm for j in module.plan(args)}
    assert "hybrid-auto" in planned and not [a for a in planned if a.startswith("softmax1-")]


def test_softmax_layer_sweep_against_latency(tmp_path):
    """--softmax-layers: K = 1 .. depth/2 kept softmax layers by each ranking (depth 2 here: K = 1), each
    stage 1 keeping exactly K layers (the fixed pattern: layer 0), beside mhla-stage1-all (K = 0), and a table
    with a measured latency per K and the paired e2e comparisons."""
    module = load_adaptation()
    records = module.main(["--smoke", "--softmax-layers", "--arms", "mhla-stage1", "--seeds", "1",
                           "--out", str(tmp_path)])
    stage1 = {r["arm"]: r["stage1"]["softmax_layers"] for r in records if "stage1" in r}
    sweep = {f"softmax1-{r}" for r in ("e2e", "layer", "fixed")}
    assert set(stage1) == {"mhla-stage1", "mhla-stage1-all", *sweep}
    assert stage1["mhla-stage1-all"] == [] and stage1["softmax1-fixed"] == [0]
    assert all(len(stage1[f"softmax1-{r}"]) == 1 for r in ("e2e", "layer"))
    table = (tmp_path / "adaptation.md").read_text().split("Softmax layers kept (of 2)")[1]
    rows = [line for line in table.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 2 and all(float(row.split(" | ")[1]) > 0 for row in rows)  # latency measured
    kept = (tmp_path / "adaptation.md").read_text().split("Layers kept as softmax")[1].split("Softmax")[0]
    assert f"| 1 | {stage1['softmax1-e2e']} | {stage1['softmax1-layer']} | [0] |" in kept
    report = (tmp_path / "adaptation.md").read_text()
    assert "`val_loss` at stage-2 step" in report
    # a decision row (stage 1 on every parameter against stage 1 on MHLA's): one seed is too few, and every
    # cell, the FID's too, drew on the points' per-sample scores (no bound ‡, nothing unknown §)
    row = next(line for line in report.splitlines() if line.startswith("| stage 1 on every parameter |"))
    assert row.count("**too few seeds**") == 5 and "(primary)" in row
    decisions = report.split("Paired comparisons")[1]
    assert "‡" not in decisions and "§" not in decisions


def test_latency_feeds_each_model_its_own_channels():
    """The sweep's latency runs models of the data's channels (3 for the shapes, 1 for the digits)."""
    from studies.softmax_layers import latency

    from mhla_gen.testing import tiny_dit

    for channels in (1, 3):
        ms = latency(lambda k, c=channels: tiny_dit(in_channels=c, out_channels=c), [0, 1],
                     tiny_dit().config.sample_size, batch=2, repeats=1)
        assert set(ms) == {0, 1} and all(v > 0 for v in ms.values())


def test_fixed_pattern_is_the_releases():
    from studies.softmax_layers import fixed_layers, sweep_ks

    assert fixed_layers(10, 30) == list(range(0, 30, 3))  # Wan2.1 release: i % 3 == 0 stays softmax
    assert fixed_layers(2, 4) == [0, 3] and fixed_layers(3, 4) == [0, 3, 1]
    assert sweep_ks(4) == [1, 2] and sweep_ks(2) == [1] and sweep_ks(28) == list(range(1, 15))


def test_shapes_recipe_reaches_training_runs_not_stage1(tmp_path):
    """On the shapes, the teachers, every stage-2 run and MHLA from scratch train with the study's
    recipe (before an arm's own overrides, so ``stage2-low-lr`` keeps its 3e-4); stage 1 keeps its own
    schedule; the digits add nothing."""
    import argparse

    from studies.experiments import SHAPES_RECIPE

    module = load_adaptation()
    args = argparse.Namespace(grids=["shapes-smoke", "smoke"], steps=None, softmax_layers=False,
                              arms=["softmax-continued", "mhla-stage1", "stage2-low-lr"],
                              seeds=1, out=tmp_path, scratch=True, report_only=True, teachers_from=None)
    jobs = module.plan(args)
    for job in jobs:
        shapes = job.extra["grid"] == "shapes-smoke"
        assert all(o in job.overrides for o in SHAPES_RECIPE) == shapes, (job.arm, job.overrides)
        if job.stage1 is not None:
            assert not any(o in job.stage1 for o in SHAPES_RECIPE)
    low = next(j for j in jobs if j.arm == "stage2-low-lr" and j.extra["grid"] == "shapes-smoke")
    rates = [o for o in low.overrides if o.startswith("train.learning_rate=")]
    assert rates[-1] == "train.learning_rate=3e-4"  # the last override wins
    assert any(j.arm == "mhla-scratch" and j.extra["grid"] == "shapes-smoke" for j in jobs)


def conversion_records(teachers=("t0", "t1", "t2"), flops=True) -> list[dict]:
    """Records of two conversion arms (seed k from a teacher of 1500 + 100 k steps' FLOPs; mhla-stage1 with
    a stage 1 of 30 steps' FLOPs) and of MHLA from scratch (10 FLOPs a step, as the arms' stage 2), whose
    FID falls 1 a step from step 1900 on."""
    recs = []
    for seed in range(3):
        flop = dict(flops_per_image=1.0, batch=10, teacher_flops=10.0 * (1500 + 100 * seed)) if flops else {}
        teacher = dict(teacher=teachers[seed]) if teachers else {}
        for step, fid in ((0, 300.0), (400, 50.0 + seed)):
            recs.append(dict(grid="g", arm="mhla-plain", seed=seed, step=step, fid=fid, val_loss=0.02,
                             **flop, **teacher))
            recs.append(dict(grid="g", arm="mhla-stage1", seed=seed, step=step, fid=fid - 5.0, val_loss=0.02,
                             stage1={"flops": 300.0}, **flop, **teacher))
        for step in (400, 1900, 2000, 2100, 2200):
            fid = 500.0 if step < 1900 else 60.0 + 2 * seed + (step - 1900) / 10
            recs.append(dict(grid="g", arm="mhla-scratch", seed=seed, step=step, fid=fid, val_loss=0.03,
                             **(dict(flops_per_image=1.0, batch=10) if flops else {})))
    return recs


def test_conversion_against_scratch_at_equal_flops_and_with_the_teacher_sunk(tmp_path):
    """Seed k's conversion (teacher k's FLOPs + stage 1 + stage 2) is paired with from-scratch seed k at the
    point of nearest FLOPs: at equal total compute step 1900 + 100 k (the teachers differ), with the
    teacher a sunk cost step 400; the match's FLOPs ratio and the number of teachers are shown."""
    module = load_adaptation()
    total = module.equal_compute_table(conversion_records(), "g")
    row = next(line for line in total.splitlines() if line.startswith("| mhla-plain − mhla-scratch"))
    # 50 + k − (60 + 2k + 10k): -21 on average; scratch at its own 1900 for every seed would give -11
    assert "| 3 | 3 | 2e+04 | 1900–2100 (1.00–1.00) |" in row and "-21.0 ± " in row, row
    assert "**resolved**" in row and "too few teachers" not in row
    stage1 = next(line for line in total.splitlines() if line.startswith("| mhla-stage1 − mhla-scratch"))
    assert "| 2.03e+04 | 1900–2100 (0.98–0.99) |" in stage1  # stage 1's FLOPs count: nearest is 30 short
    sunk = module.equal_compute_table(conversion_records(), "g", sunk=True)
    assert "teacher a sunk cost" in sunk
    row = next(line for line in sunk.splitlines() if line.startswith("| mhla-plain − mhla-scratch"))
    assert "| 3 | 3 | 4e+03 | 400–400 (1.00–1.00) |" in row and "-449.0 ± " in row, row  # 50 + k − 500
    recs = [dict(r, tokens=64) for r in conversion_records()]
    assert "both readings" in module.plot_compute(recs, "g", tmp_path / "compute_g.png")
    assert (tmp_path / "compute_g.png").stat().st_size > 0


def test_one_teacher_for_every_seed_decides_nothing():
    """The teacher is part of the seed unit: three seeds from one teacher (or records of before
    2026-11-28, which name none) give "too few teachers"; records without FLOPs are not read at equal
    compute (the row says so)."""
    module = load_adaptation()
    for teachers in (("t0", "t0", "t0"), None):
        table = module.equal_compute_table(conversion_records(teachers), "g")
        row = next(line for line in table.splitlines() if line.startswith("| mhla-plain − mhla-scratch"))
        assert row.count("**too few teachers**") == 2 and "| 3 | 1 |" in row, row
    decisions = module.decisions(conversion_records(("t0", "t0", "t0")), [0, 400])
    row = next(line for line in decisions.splitlines() if line.startswith("| stage 1's head start"))
    assert "**too few teachers**" in row and "**resolved**" not in row
    old = module.equal_compute_table(conversion_records(flops=False), "g")
    assert "| mhla-plain − mhla-scratch | — | — | not recorded" in old


def test_each_seed_starts_from_its_own_teacher(tmp_path):
    """--teachers-from several studies (teachers of several budgets): seed k's stage 1 and stage 2 start
    from the k-th teacher, every record carries its teacher and ``teacher_flops`` (from its config.yaml:
    steps x batch x train_flops_per_image), and from-scratch seed k is evaluated where its FLOPs meet
    seed k's conversion (with and without the teacher)."""
    import argparse

    from studies.teachers import training_flops

    from mhla_gen.train.config import DiTRunConfig, load_config

    module = load_adaptation()
    first = fake_study(module, tmp_path / "a", seeds=(0, 1), budgets=(4, 8))
    second = fake_study(module, tmp_path / "b", seeds=(3,), budgets=(16,))
    args = argparse.Namespace(grids=["smoke"], steps=None, softmax_layers=False, seeds=3,
                              arms=["mhla-plain", "mhla-stage1"], out=tmp_path / "out", scratch=True,
                              report_only=False, teachers_from=[first, second])
    jobs = module.plan(args)
    runs = [first / "smoke/runs/softmax/seed0", first / "smoke/runs/softmax/seed1",
            second / "smoke/runs/softmax/seed3"]
    for job in (j for j in jobs if j.arm != "mhla-scratch"):
        run = runs[job.seed]
        cfg = load_config(DiTRunConfig, run / "config.yaml")
        assert job.extra["teacher"] == str(run.resolve()) and job.extra["teacher_index"] == job.seed
        assert job.extra["teacher_flops"] == training_flops(cfg) > 0
        assert job.extra["teacher_steps"] == (4, 8, 16)[job.seed]
        starts = [o for o in (*job.overrides, *(job.stage1 or ())) if "init_from" in o]
        assert starts == [f"model.init_from={(run / 'final').resolve()}"], starts
    scratch = {j.seed: j.steps for j in jobs if j.arm == "mhla-scratch"}
    for seed, teacher_steps in enumerate((4, 8, 16)):  # the scratch model's steps cost the teacher's
        assert {4, 6, teacher_steps + 4, teacher_steps + 6} <= set(scratch[seed]), scratch
    args.seeds = 4
    with pytest.raises(ConfigError, match="--seeds 4 needs 4 softmax teachers"):
        module.plan(args)


def test_bad_teachers_are_refused_before_any_work(tmp_path):
    """A teacher run without its record (config.yaml) or unfinished, of another model (eval/study.py
    --smoke's depth-1 model) or another resolution: one line each, nothing written under --out."""
    module = load_adaptation()
    out = tmp_path / "out"
    no_record = fake_study(module, tmp_path / "a")
    (no_record / "smoke/runs/softmax/seed0/config.yaml").unlink()
    unfinished = fake_study(module, tmp_path / "b")
    (unfinished / "smoke/runs/softmax/seed0/final").rmdir()
    cases = [(no_record, "seed0 has no config.yaml"), (unfinished, "seed0 has no final/"),
             (fake_study(module, tmp_path / "c", depth=1), r"another grid or model: model.depth=1 \(the "
              r"grid's: 2\)"),
             (fake_study(module, tmp_path / "d", patch_size=4), "model.patch_size=4")]
    for study, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            module.main(["--smoke", "--arms", "mhla-plain", "--out", str(out), "--teachers-from", str(study)])
        assert "\n" not in str(err.value)
        assert not out.exists()


def test_an_out_of_other_teachers_is_refused(tmp_path):
    """Resuming into an --out whose runs started from another teacher is refused: a seed's runs would
    continue from one teacher and be read as another's."""
    import argparse

    module = load_adaptation()
    study = fake_study(module, tmp_path / "a", seeds=(0, 1))
    args = argparse.Namespace(grids=["smoke"], steps=None, softmax_layers=False, seeds=2, arms=["mhla-plain"],
                              out=tmp_path / "out", scratch=False, report_only=False, teachers_from=[study])
    jobs = module.plan(args)
    for job, teacher in zip(jobs, ("another run", None)):  # seed 1: a run of before 2026-11-28 (teacher 0)
        path = experiments.result_path(job, 0)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({} if teacher is None else {"teacher": teacher}))
    with pytest.raises(ConfigError, match="mhla-plain seed 0 started from another run"):
        module.check_teachers(jobs)
    jobs[0].extra["teacher"] = "another run"
    with pytest.raises(ConfigError, match="seed 1 started from teacher 0"):
        module.check_teachers(jobs)


def test_decisions_pair_the_mid_noise_validation_bucket():
    """The decision table pairs FID and validation loss at a quarter of the budget and at its end, and the
    mid-noise bucket (b2) at the end, where a difference the total hides can resolve."""
    module = load_adaptation()
    recs = [dict(arm=arm, seed=seed, step=step, fid=50.0, val_loss=0.05 + 0.001 * seed,
                 val_loss_b2=0.004 + (0.0006 if arm == "mhla-stage1" else 0.0) + 0.00001 * seed,
                 teacher=f"teacher {seed}")
            for arm in ("mhla-plain", "mhla-stage1") for seed in range(3) for step in (0, 100, 400)]
    table = module.decisions(recs, [0, 100, 400])
    assert "| mid-noise val loss (b2) at step 400 |" in table
    row = next(line for line in table.splitlines() if line.startswith("| stage 1's head start"))
    b2 = row.rstrip(" |").split(" | ")[-1]
    # every seed +0.0006: no seed spread; records without per-sample scores: the triples' noise unknown (§)
    assert b2.startswith("+0.00060 ± 0.00000 **resolved**, MDD 0.00014, Holm p") and b2.endswith("§")
    primary = row.split(" | ")[5]  # val loss at step 100, the question's primary: level here
    assert primary.startswith("+0.0000 ± 0.0000") and "(primary)" in primary


def test_shapes_report_carries_the_exact_properties():
    """On the shapes the report shows each arm's property scores at a quarter of stage 2 and at its end,
    and the decision table pairs the count accuracy and symmetric rate (rates: never narrower than their
    binomial noise on the scored samples); on the digits neither appears."""
    module = load_adaptation()
    recs = [dict(grid="g", data="shapes", tokens=256, fid_samples=300, val_triples=64, arm=arm, seed=seed,
                 step=step, fid=50.0, val_loss=0.02, val_loss_b2=0.004, label_accuracy=0.9,
                 all_correct=0.1, count_accuracy=0.3, colour_accuracy=0.9, symmetry_error=0.05,
                 symmetric_rate=(0.6 if arm == "mhla-stage1" else 0.1) + 0.01 * seed, teacher=f"t{seed}")
            for arm in ("mhla-plain", "mhla-stage1") for seed in range(3) for step in (0, 150, 600)]
    report = module.grid_report(recs, "g")
    assert "| arm | all 4 properties ↑ at 150 |" in report and "symmetry error ↓ at 600 |" in report
    assert "† measured with the shapes scorer's version 1" in report  # records without shapes_scorer
    row = next(line for line in report.splitlines() if line.startswith("| mhla-stage1 | 0.100"))
    assert "0.610 ± 0.025" in row  # symmetric at 600: 0.60, 0.61, 0.62
    head = next(line for line in report.splitlines() if line.startswith("| question |"))
    assert head.endswith("| count ↑ at step 600 | symmetric ↑ at step 600 |")
    decision = next(line for line in report.splitlines() if line.startswith("| stage 1's head start"))
    assert decision.rstrip(" |").split(" | ")[-1].startswith("+0.500 ± ") and "**resolved**" in decision
    digits = module.grid_report([dict(r, data="digits") for r in recs], "g")
    assert "Exact property" not in digits and "symmetric" not in digits and "count" not in digits


def test_a_question_without_a_primary_metric_is_refused(tmp_path, monkeypatch):
    from studies.evidence import Question

    from mhla_gen.errors import ConfigError

    module = load_adaptation()
    unnamed = Question("q", "mhla-plain", "mhla-stage1", None)
    monkeypatch.setattr(module, "DECISIONS", [*module.DECISIONS, unnamed])
    with pytest.raises(ConfigError, match="primary metric"):
        module.main(["--smoke", "--out", str(tmp_path / "a")])
    assert not (tmp_path / "a").exists()


def test_end_to_end_column_is_the_mean_over_seeds():
    recs = [{"arm": "mhla-stage1", "seed": seed, "step": step,
             "stage1": {"end_to_end_before": 0.1 - 0.05 * seed, "end_to_end_final": 0.06 - 0.02 * seed}}
            for seed in (0, 1) for step in (0, 4)]
    module = load_adaptation()
    assert module.end_to_end(recs, "mhla-stage1") == "0.075 → 0.050"
    assert module.end_to_end(recs, "mhla-plain") == "—"


def sweep_records(teachers) -> list[dict]:
    """Stage-2 end points of the softmax-layer sweep at depth 2 (K = 1) and of its K = 0 arm, 3 seeds: the
    end-to-end ranking 10 FID better than the fixed one in every seed (a clear difference)."""
    from studies.softmax_layers import RANKINGS, arm_name

    recs = []
    for seed in range(3):
        fids = {arm_name(r, 1): 60.0 + seed for r in RANKINGS} | {arm_name("e2e", 1): 50.0 + seed, "k0": 70.0}
        recs += [dict(arm=arm, seed=seed, step=400, fid=fid, teacher=teachers[seed])
                 for arm, fid in fids.items()]
    return recs


def test_the_softmax_layer_sweep_applies_the_teacher_rule():
    """A sweep whose seeds start from one teacher decides nothing about which layers to keep ("too few
    teachers"); three teachers let the same differences resolve."""
    from studies.softmax_layers import metric_table

    def first_row(teachers):
        table = metric_table(sweep_records(teachers), "fid", 400, {}, 2, "k0")
        return next(line for line in table.splitlines() if line.startswith("| 1 |"))

    assert "too few teachers" in first_row(("t0", "t0", "t0"))
    three = first_row(("t0", "t1", "t2"))
    assert "too few teachers" not in three and "resolved" in three


def test_adaptation_never_writes_inside_a_teachers_study(tmp_path):
    """--out inside (or holding) a --teachers-from study is refused in one line before anything is
    written: the study is an input of the command."""
    from mhla_gen.errors import ConfigError

    module = load_adaptation()
    study = fake_study(module, tmp_path / "study")
    before = sorted(p.relative_to(study) for p in study.rglob("*"))
    for out in (study / "adaptation", tmp_path):
        with pytest.raises(ConfigError, match="an input of this command") as err:
            module.main(["--smoke", "--arms", "mhla-plain", "--out", str(out), "--teachers-from", str(study)])
        assert f"--teachers-from={str(study)!r}" in str(err.value) and "\n" not in str(err.value)
    assert sorted(p.relative_to(study) for p in study.rglob("*")) == before
