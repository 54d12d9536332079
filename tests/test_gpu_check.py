"""scripts/gpu_check.py on CPU: its one-line refusal without CUDA, its report and output folder (fake device
layer and injected section runners), the kernel-test gate, the time budget, its section runner's statuses,
the flags every section passes to its script, and the ``--dry-run`` plumbing of every section."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from script_helpers import load_script
from train_helpers import running

from mhla_gen.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
FAKE_ENVIRONMENT = {"GPU": "Fake H100, 80 GiB", "driver": "999.1", "CUDA (torch)": "12.9", "torch": "2.x",
                    "triton": "3.x", "diffusers": "0.42.1", "copy bandwidth": "4000 GB/s"}


@pytest.fixture(scope="module")
def gpu_check():
    return load_script(REPO / "scripts" / "gpu_check.py")


def fake_runner(gpu_check, outcomes: dict, calls: list | None = None, clock: list | None = None):
    """A section runner returning ``outcomes[name] = (status, output)`` ("passed", "" by default), recording
    ``(name, limit)`` and advancing the fake ``clock`` by 10 s per section."""

    def run(section, limit, folder, **streaming):  # log=, progress=: the real runner's
        if calls is not None:
            calls.append((section.name, limit))
        if clock is not None:
            clock[0] += 10.0
        status, output = outcomes.get(section.name, ("passed", ""))
        return gpu_check.SectionResult(section.name, section.command, status, 12.3, output)

    return run


def test_refuses_without_cuda_in_one_line(tmp_path):
    command = [sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path / "R.md")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu_check.py: error: no CUDA device (torch.cuda.is_available() is False): gpu_check runs on a GPU "
        "machine"
    ]
    assert not (tmp_path / "R.md").exists() and not (tmp_path / "R.files").exists()


def test_sections_in_order_within_the_budget(gpu_check):
    names = [s.name for s in gpu_check.default_sections()]
    assert names == ["kernel tests", "profile", "CUDA graphs", "small-N crossover", "tile sweep",
                     "Wan2.1-1.3B step", "DiT-XL/2 training step", "SANA-1.6B 1024 px step", "host overhead",
                     "Wan2.1-1.3B step, compiled", "other gpu tests", "kernel check", "scale-study sizing",
                     "scale study", "dense kernel check", "stream study on cuda"]
    assert "tile sweep" not in [s.name for s in gpu_check.default_sections(skip_tiles=True)]
    sections = gpu_check.default_sections()
    assert sections[0].gate and not sections[0].trusts_kernels
    assert [s.name for s in sections if s.optional] == names[-7:]
    assert gpu_check.DEFAULT_BUDGET_S <= 7 * 60
    study = [s for s in sections if s.name.startswith("scale")]  # run alone, they fit the default budget
    assert 60 + study[1].timeout_s + gpu_check.STOP_RESERVE_S <= gpu_check.DEFAULT_BUDGET_S  # sizing: < 1 min
    assert study[1].needs_output == study[0].writes[0] == gpu_check.SIZING_FILE


def test_report_lists_environment_summary_and_every_section(gpu_check, tmp_path):
    outcomes = {
        "profile": ("passed", "| kernel |\n" * 700),
        "CUDA graphs": ("failed (exit 1)", "boom"),
        "Wan2.1-1.3B step": ("timed out after 75 s", "timed wan480\n" * 850),
    }
    out = tmp_path / "REPORT.md"
    status = gpu_check.main(["--out", str(out)], probe=lambda: FAKE_ENVIRONMENT,
                            runner=fake_runner(gpu_check, outcomes))
    assert status == 1  # sections did not pass: reported, not fatal, and the exit status says so
    text = out.read_text()
    assert text.startswith(gpu_check.REPORT_RECORD + "\n# mhla_gen GPU check\n")
    sections = gpu_check.default_sections()
    ran = [s for s in sections if (s.needs_file is None or s.needs_file.is_file())
           and s.needs_output is None  # the fake sizing writes no file: the scale study is left out
           and s.covered_by is None]  # the kernel check: the kernel tests passed before it
    assert f"{len(ran) - 2} / {len(sections)} sections passed" in text
    for key, value in FAKE_ENVIRONMENT.items():
        assert f"| {key} | {value} |" in text
    for name, (state, _) in outcomes.items():
        assert f"| {name} | {state} | 12 s |" in text and f"\n## {name}\n" in text
    assert "| tile sweep | not run (benchmarks/tune_mhla_tiles.py does not exist) | |" in text or \
        (REPO / "benchmarks" / "tune_mhla_tiles.py").is_file()
    assert "boom" in text and "[... 770 earlier lines]" in text  # long outputs keep their tail ...
    assert text.count("| kernel |") == 700  # ... except the profile's, kept whole
    assert "--dtype bf16" in text and "--cuda-graphs" in text and "-m gpu" in text

    folder = tmp_path / "REPORT.files"  # every section's whole output beside the report, listed as ours
    assert (folder / ".mhla_gen.json").is_file()
    wan = folder / "06-wan2-1-1-3b-step.txt"
    assert wan.read_text().count("timed wan480") == 850 and "REPORT.files/06-wan2-1-1-3b-step.txt" in text
    from mhla_gen.outputs.folders import listed

    assert set(listed(folder)) == {p.name for p in folder.glob("*.txt")}

    only = ["--out", str(out), "--only", "kernel tests"]
    assert gpu_check.main(only, probe=lambda: FAKE_ENVIRONMENT, runner=fake_runner(gpu_check, {})) == 0
    assert "| CUDA graphs |" not in out.read_text()  # its own report and folder are replaced


def test_failed_kernel_tests_leave_every_benchmark_not_run(gpu_check, tmp_path):
    calls = []
    outcomes = {"kernel tests": ("failed (exit 1)", "F.. 1 failed")}
    out = tmp_path / "R.md"
    status = gpu_check.main(["--out", str(out), "--budget-s", "10000"], probe=lambda: FAKE_ENVIRONMENT,
                            runner=fake_runner(gpu_check, outcomes, calls))
    assert status == 1
    assert [name for name, _ in calls] == ["kernel tests", "other gpu tests", "kernel check",
                                           "dense kernel check"]  # tests only
    text = out.read_text()
    for section in gpu_check.default_sections():
        if section.trusts_kernels:
            assert (f"| {section.name} | not run (the kernel tests did not pass: kernel tests failed "
                    "(exit 1)) | |") in text


def test_time_budget_cuts_limits_and_leaves_optional_sections_out(gpu_check, tmp_path, monkeypatch):
    """A fake clock: each section takes 10 s. Limits are cut to the time left less the 35 s a stop may
    take (Ctrl-C, its grace, SIGKILL), so that a section stopped at its limit still ends within the
    budget; a section is not started with under MIN_SECTION_S of limit; optional sections need their
    whole limit."""
    clock = [0.0]
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    calls = []
    out = tmp_path / "R.md"
    runner = fake_runner(gpu_check, {}, calls, clock)
    status = gpu_check.main(["--out", str(out), "--budget-s", "85", "--skip-tiles"],
                            probe=lambda: FAKE_ENVIRONMENT, runner=runner)
    assert gpu_check.STOP_RESERVE_S == gpu_check.STOP_GRACE_S + gpu_check.KILL_WAIT_S == 35
    assert calls == [("kernel tests", 50.0), ("profile", 40.0), ("CUDA graphs", 30.0),
                     ("small-N crossover", 20.0)]
    assert status == 1  # required sections were left out
    text = out.read_text()
    stop = "and 35 s for a stop) | |"
    assert f"| Wan2.1-1.3B step | not run (time budget: 45 s left, 20 s needed {stop}" in text
    assert f"| other gpu tests | not run (time budget: 45 s left, 150 s needed {stop}" in text
    clock[0], calls[:] = 0.0, []
    budget = "445"  # 11 sections of 10 s and 335 s left: the optional benchmarks, sizing and study fit
    (out.with_name("R.files") / gpu_check.SIZING_FILE).write_text("{}")  # as if the sizing had written it
    assert gpu_check.main(["--out", str(out), "--budget-s", budget, "--skip-tiles"],
                          probe=lambda: FAKE_ENVIRONMENT, runner=runner) == 0
    assert [name for name, _ in calls][-5:] == ["Wan2.1-1.3B step, compiled", "other gpu tests",
                                                 "scale-study sizing", "scale study", "stream study on cuda"]
    text = out.read_text()  # its tests are a subset of the kernel tests, which passed first
    assert "| kernel check | not run (kernel tests passed in this run: its tests include these) | |" in text


def test_the_scale_study_runs_alone_in_the_default_budget_after_its_sizing(gpu_check, tmp_path, monkeypatch):
    """``--only "scale-study sizing" "scale study"``: both fit the default budget; the study runs only when
    the sizing wrote its file into the folder beside the report (a failed sizing leaves it out)."""
    clock = [0.0]
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    only = ["--only", "scale-study sizing", "scale study"]

    def sizing_writes(inner):
        def run(section, limit, folder, **streaming):
            if section.name == "scale-study sizing":
                (folder / gpu_check.SIZING_FILE).write_text("{}")
            return inner(section, limit, folder)
        return run

    calls = []
    out = tmp_path / "R.md"
    runner = sizing_writes(fake_runner(gpu_check, {}, calls, clock))
    assert gpu_check.main(["--out", str(out), *only], probe=lambda: FAKE_ENVIRONMENT, runner=runner) == 0
    sizing = float(gpu_check.SIZING_LIMIT_S)
    assert calls == [("scale-study sizing", sizing), ("scale study", float(gpu_check.STUDY_LIMIT_S))]
    study = next(s for s in gpu_check.default_sections() if s.name == "scale study")
    assert f"{{outputs}}/{gpu_check.SIZING_FILE}" in study.command  # it reads what the sizing wrote
    clock[0], calls[:] = 0.0, []
    failed = fake_runner(gpu_check, {"scale-study sizing": ("failed (exit 1)", "boom")}, calls, clock)
    assert gpu_check.main(["--out", str(tmp_path / "F.md"), *only], probe=lambda: FAKE_ENVIRONMENT,
                          runner=failed) == 1
    assert calls == [("scale-study sizing", sizing)]
    assert (f"| scale study | not run (no {gpu_check.SIZING_FILE} beside the report: its section did not "
            "write it) | |") in (tmp_path / "F.md").read_text()


def test_a_failed_kernel_check_leaves_the_scale_study_out(gpu_check, tmp_path, monkeypatch):
    """The GPU window's selection: the kernel check, then the sizing and the study, in 500 s; the study
    trains with the Triton kernels, so a kernel check that fails, or runs out of time, leaves both out
    (the report names it and its status); the dense path's tests, after the study, still run."""
    clock = [0.0]
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    only = ["--budget-s", "500", "--only", "kernel check", "scale-study sizing", "scale study"]
    calls = []
    runner = fake_runner(gpu_check, {}, calls, clock)
    gpu_check.main(["--out", str(tmp_path / "R.md"), *only], probe=lambda: FAKE_ENVIRONMENT, runner=runner)
    limit = float(gpu_check.KERNEL_CHECK_LIMIT_S)
    assert calls[:2] == [("kernel check", limit), ("scale-study sizing", float(gpu_check.SIZING_LIMIT_S))]
    check = next(s for s in gpu_check.default_sections() if s.name == "kernel check")
    assert check.gate and "bfloat16" in " ".join(check.command)
    clock[0], calls[:] = 0.0, []
    failed = fake_runner(gpu_check, {"kernel check": ("failed (exit 1)", "F 1 failed")}, calls, clock)
    assert gpu_check.main(["--out", str(tmp_path / "F.md"), *only], probe=lambda: FAKE_ENVIRONMENT,
                          runner=failed) == 1
    assert calls == [("kernel check", float(gpu_check.KERNEL_CHECK_LIMIT_S))]
    text = (tmp_path / "F.md").read_text()
    assert "| scale study | not run (the kernel tests did not pass: kernel check failed (exit 1)) | |" in text
    clock[0], calls[:] = 0.0, []
    timed_out = fake_runner(gpu_check, {"kernel check": ("timed out after 90 s", "....")}, calls, clock)
    assert gpu_check.main(["--out", str(tmp_path / "T.md"), *only, "dense kernel check"],
                          probe=lambda: FAKE_ENVIRONMENT, runner=timed_out) == 1
    assert [name for name, _ in calls] == ["kernel check", "dense kernel check"]
    text = (tmp_path / "T.md").read_text()
    assert ("| scale-study sizing | not run (the kernel tests did not pass: kernel check timed out after "
            "90 s)") in text



def test_the_scale_study_starts_with_its_first_grids_time_left(gpu_check, tmp_path, monkeypatch):
    """A slow kernel check or sizing does not cost the whole study: with less than its limit but at least
    STUDY_SHORTEST_S left (after the 35 s kept for a stop) it runs with what is left (stopped there, it
    keeps its finished points: the 4096 grid first); with less it is not run, and the report says why."""
    clock = [0.0]
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    only = ["--only", "kernel check", "scale-study sizing", "scale study"]

    def run(budget: int, name: str):
        calls = []
        inner = fake_runner(gpu_check, {}, calls, clock)

        def runner(section, limit, folder, **streaming):
            if section.name == "scale-study sizing":
                (folder / gpu_check.SIZING_FILE).write_text("{}")
            return inner(section, limit, folder)

        clock[0] = 0.0
        gpu_check.main(["--out", str(tmp_path / name), "--budget-s", str(budget), *only],
                       probe=lambda: FAKE_ENVIRONMENT, runner=runner)
        return calls

    assert gpu_check.STUDY_SHORTEST_S == 180 < gpu_check.STUDY_LIMIT_S
    assert run(290, "A.md")[-1] == ("scale study", 290 - 20 - 35.0)  # two sections of 10 s before it
    calls = run(225, "B.md")  # 205 s left, 170 after the stop's 35: under 180
    assert [name for name, _ in calls] == ["kernel check", "scale-study sizing"]
    assert ("| scale study | not run (time budget: 205 s left, 180 s needed and 35 s for a stop) | |"
            in (tmp_path / "B.md").read_text())

def test_the_kernel_check_gates_on_the_study_path_its_shapes_first(gpu_check):
    """The kernel check (the study's gate) collects the blocked path's bf16 tests, those at the study's
    shapes first (a time limit cuts the others); the dense path's bf16 tests are their own section, no
    gate, after the study."""
    sections = {s.name: s for s in gpu_check.default_sections()}
    names = list(sections)
    assert names.index("scale study") < names.index("dense kernel check")
    dense = sections["dense kernel check"]
    assert sections["kernel check"].gate and not dense.gate and not dense.trusts_kernels

    def collected(section):
        command = [a for a in section.dry_command if a != "-q"]
        result = subprocess.run([*command, "-q"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return [line for line in result.stdout.splitlines() if "::" in line]

    gate = collected(sections["kernel check"])
    assert len(gate) == 8 and all("bfloat16" in t and "dense" not in t for t in gate)
    assert all("scale_study_shapes" in t for t in gate[:2]) and "scale_study_shapes" not in " ".join(gate[2:])
    later = collected(dense)
    assert len(later) == 6 and all("bfloat16" in t and t.endswith("-dense]") for t in later)


def test_foreign_report_file_is_refused_before_any_section(gpu_check, tmp_path):
    out = tmp_path / "REPORT.md"
    out.write_text("my notes\n")

    def runner(section, limit, folder):
        raise AssertionError("no section may run")

    with pytest.raises(ConfigError, match="was not written by gpu_check"):
        gpu_check.main(["--out", str(out)], probe=lambda: FAKE_ENVIRONMENT, runner=runner)
    assert out.read_text() == "my notes\n"
    with pytest.raises(ConfigError, match="no CUDA"):  # the device is checked first of all
        gpu_check.main(["--out", str(tmp_path / "new.md")], runner=runner,
                       probe=lambda: (_ for _ in ()).throw(ConfigError("no CUDA device")))
    (tmp_path / "mine.files").mkdir()
    (tmp_path / "mine.files" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not written by mhla_gen"):  # a user's folder beside the report
        gpu_check.main(["--out", str(tmp_path / "mine.md")], probe=lambda: FAKE_ENVIRONMENT, runner=runner)
    assert not (tmp_path / "mine.md").exists()
    with pytest.raises(ConfigError, match="does not exist"):  # a missing folder, named before any work
        gpu_check.main(["--out", str(tmp_path / "no" / "REPORT.md")], probe=lambda: FAKE_ENVIRONMENT,
                       runner=runner)


def test_section_runner_statuses(gpu_check, tmp_path):
    python = sys.executable
    cases = {
        "passed": [python, "-c", "import os; print('hello', os.environ['GPU_CHECK_OUT'])"],
        "failed (exit 3)": [python, "-c", "import sys; print('bad'); sys.exit(3)"],
        "timed out after 1 s": [python, "-c", "import time; print('slow', flush=True); time.sleep(30)"],
    }
    for expected, command in cases.items():
        limit = 1 if "timed" in expected else 60
        result = gpu_check.run_section(gpu_check.Section("s", command, limit), outputs=tmp_path)
        assert result.status == expected, (expected, result.output)
    passed = gpu_check.run_section(gpu_check.Section("s", cases["passed"], 60), 60, tmp_path)
    assert f"hello {tmp_path}" in passed.output
    missing = gpu_check.run_section(gpu_check.Section("s", ["/nonexistent/program"], 5))
    assert missing.status.startswith("could not start") and not missing.passed


def test_a_section_past_its_limit_gets_ctrl_c_then_sigkill(gpu_check, tmp_path, monkeypatch):
    """Past its limit a section is interrupted (it may keep what it finished) and, if it goes on, killed
    with its whole process group (a study's workers included)."""
    python, kept, child = sys.executable, tmp_path / "kept.txt", tmp_path / "worker.pid"
    keeps = ("import time\ntry:\n    print('training', flush=True); time.sleep(30)\n"
             f"except KeyboardInterrupt:\n    open({str(kept)!r}, 'w').write('record')\n    raise\n")
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job: children inherit it
    try:
        result = gpu_check.run_section(gpu_check.Section("s", [python, "-c", keeps], 1))
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert result.status == "timed out after 1 s" and "training" in result.output
    assert kept.read_text() == "record" and "KeyboardInterrupt" in result.output

    monkeypatch.setattr(gpu_check, "STOP_GRACE_S", 1)
    ignores = ("import signal, subprocess, sys, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
               "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
               f"open({str(child)!r}, 'w').write(str(worker.pid))\ntime.sleep(60)\n")
    start = time.monotonic()
    result = gpu_check.run_section(gpu_check.Section("s", [python, "-c", ignores], 2))
    assert result.status == "timed out after 2 s" and time.monotonic() - start < 30
    worker = int(child.read_text())  # SIGKILLed with its parent's group
    assert _gone(worker, 5.0), f"the section's worker {worker} is still running"


def test_a_section_streams_its_output_to_its_file_as_it_runs(gpu_check, tmp_path, monkeypatch):
    """What a section prints is in its output file while it runs (Python unbuffered: a print without
    flush included), after a first line with its command; ``progress`` sees it too. A check killed from
    outside leaves that file."""
    monkeypatch.setattr(gpu_check, "PROGRESS_S", 0.2)
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # the section's environment sets it
    log, seen = tmp_path / "01-s.txt", []

    def progress(seconds, output):
        seen.append((output, log.read_text()))

    command = [sys.executable, "-c", "import time; print('early'); time.sleep(30)"]
    result = gpu_check.run_section(gpu_check.Section("s", command, 3), log=log, progress=progress)
    assert result.status == "timed out after 3 s" and result.output.startswith("early")
    assert any("early" in output for output, _ in seen), seen
    output, on_disk = next((o, d) for o, d in seen if "early" in o)
    assert on_disk == gpu_check.running_header(gpu_check.Section("s", command, 3)) + output
    assert on_disk.startswith(f"$ {sys.executable} -c") and "\nrunning (" in on_disk


def test_the_report_is_rewritten_while_a_section_runs(gpu_check, tmp_path):
    """The report shows a running section (its time and output so far) and names its output file, listed
    as ours before the section starts; once it ends, the file holds its command, status and output."""
    from mhla_gen.outputs.folders import listed

    out, during = tmp_path / "R.md", []

    def runner(section, limit, folder, log, progress):
        progress(5.0, "halfway there")
        during.append((out.read_text(), set(listed(folder)), log.name))
        return gpu_check.SectionResult(section.name, section.command, "passed", 6.0, "all done")

    assert gpu_check.main(["--out", str(out), "--only", "profile"], probe=lambda: FAKE_ENVIRONMENT,
                          runner=runner) == 0
    report, names, name = during[0]
    assert "| profile | running (5 s so far) | 5 s |" in report and "halfway there" in report
    assert f"R.files/{name}" in report and name in names and name == "01-profile.txt"
    assert "| profile | passed | 6 s |" in out.read_text()
    text = (tmp_path / "R.files" / name).read_text()
    assert text.endswith("passed\n\nall done") and text.startswith("$ ")


def _gone(pid: int, seconds: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not running(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_section_dies_with_the_check_that_runs_it(gpu_check, tmp_path):
    """A check killed with SIGKILL (a caller's time limit) leaves no section running on the device."""
    pid_file = tmp_path / "section.pid"
    section = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid()));"
               " time.sleep(60)"]
    runner = ("import sys; sys.path.insert(0, 'tests'); from script_helpers import load_script\n"
              "g = load_script('scripts/gpu_check.py')\n"
              f"g.run_section(g.Section('s', {section!r}, 60))\n")
    check = subprocess.Popen([sys.executable, "-c", runner], cwd=REPO)
    try:
        for _ in range(300):
            if pid_file.is_file() and pid_file.read_text():
                break
            time.sleep(0.1)
        section_pid = int(pid_file.read_text())
    finally:
        check.kill()
        check.wait()
    assert _gone(section_pid), f"the section {section_pid} outlived its check"


def _parse(script: Path, argv: list[str]):
    module = load_script(script)
    if hasattr(module, "parse_args"):
        return module.parse_args(argv)
    return None  # profile_mhla parses inside main (no arguments are passed on CUDA)


def test_sections_call_the_scripts_with_flags_they_accept(gpu_check, monkeypatch):
    """Flag typos would only show on a GPU: parse each command, and each dry-run command, with its script's
    own parser (CUDA faked present: the scripts check --device cuda while parsing)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for section in gpu_check.default_sections():
        for command in (section.command, section.dry_command):
            if command[1] == "-m":  # pytest
                assert command[2:5] == ["pytest", "-m", "gpu"]
                continue
            script = Path(command[1])
            if not script.is_file():
                assert section.needs_file == script  # the tile sweep, not written yet
                continue
            if "--help" in command:
                continue
            args = _parse(script, command[2:])
            if args is not None and command is section.command:
                assert str(args.device).startswith("cuda"), section.name
    sections = {s.name: s for s in gpu_check.default_sections()}
    assert "--compile" in sections["Wan2.1-1.3B step, compiled"].command
    assert "--cuda-graphs" in sections["small-N crossover"].command


@pytest.mark.slow
def test_dry_run_runs_every_section_on_cpu(tmp_path):
    """``--dry-run``: every section's plumbing (test collection, --help, tiny CPU runs) passes, without CUDA,
    and the report says so (the tile sweep is left out while its script does not exist)."""
    out = tmp_path / "R.md"
    command = [sys.executable, "scripts/gpu_check.py", "--out", str(out), "--dry-run"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
    text = out.read_text()
    summary = text.split("## Summary")[1].split("\n## ")[0]
    assert result.returncode == 0, summary + result.stderr[-3000:]
    gpu_check = load_script(REPO / "scripts" / "gpu_check.py")
    covered = []
    for section in gpu_check.default_sections():
        if gpu_check.excused(section) and not section.optional:
            assert f"| {section.name} | not run" in text
        elif section.covered_by is not None:  # the kernel check: the kernel tests passed before it
            assert f"| {section.name} | not run ({section.covered_by} passed in this run" in text
            covered.append(section.name)
        else:
            assert f"| {section.name} | passed |" in text, section.name
    assert "| GPU | none (dry run: CPU plumbing only) |" in text
    alone = subprocess.run([*command, "--only", *covered], cwd=REPO, capture_output=True, text=True,
                           timeout=600)  # run alone, as on a lent machine: its own plumbing passes
    assert alone.returncode == 0 and all(f"| {name} | passed |" in out.read_text() for name in covered)
