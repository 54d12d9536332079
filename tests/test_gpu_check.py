"""scripts/gpu_check.py on CPU: its one-line refusal without CUDA, its report (fake device layer and
injected section runners), its section runner's statuses, and benchmark flags the scripts accept."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mhla_gen.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
FAKE_ENVIRONMENT = {"GPU": "Fake H100, 80 GiB", "driver": "999.1", "CUDA (torch)": "12.9", "torch": "2.x",
                    "triton": "3.x", "diffusers": "0.42.1"}


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    return load_script(REPO / "scripts" / "gpu_check.py")


def test_refuses_without_cuda_in_one_line(tmp_path):
    command = [sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path / "R.md")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu_check.py: error: no CUDA device (torch.cuda.is_available() is False): gpu_check runs on a GPU "
        "machine"
    ]
    assert not (tmp_path / "R.md").exists()


def test_report_lists_environment_summary_and_every_section(gpu_check, tmp_path):
    outcomes = {
        "gpu tests": ("passed", "12 passed in 80s"),
        "profile": ("passed", "| kernel |"),
        "operator benchmark": ("failed (exit 1)", "boom"),
        "Wan2.1-1.3B step": ("timed out after 180 s", "timed wan480\n" * 850),
    }

    def fake_runner(section):
        status, output = outcomes[section.name]
        return gpu_check.SectionResult(section.name, section.command, status, 12.3, output)

    out = tmp_path / "REPORT.md"
    status = gpu_check.main(["--out", str(out)], probe=lambda: FAKE_ENVIRONMENT, runner=fake_runner)
    assert status == 1  # one section did not pass: reported, not fatal, and the exit status says so
    text = out.read_text()
    assert text.startswith(gpu_check.REPORT_RECORD + "\n# mhla_gen GPU check\n")
    assert "2 / 4 sections passed" in text
    for key, value in FAKE_ENVIRONMENT.items():
        assert f"| {key} | {value} |" in text
    for name, (state, _) in outcomes.items():
        assert f"| {name} | {state} | 12 s |" in text and f"\n## {name}\n" in text
    assert "boom" in text and "[... 250 earlier lines]" in text  # long outputs keep their tail
    assert "--dtype bf16" in text and "21x30x52:3x5x10" in text and "-m gpu" in text

    assert gpu_check.main(["--out", str(out), "--only", "gpu tests"], probe=lambda: FAKE_ENVIRONMENT,
                          runner=fake_runner) == 0  # its own report is replaced
    assert "| operator benchmark |" not in out.read_text()


def test_foreign_report_file_is_refused_before_any_section(gpu_check, tmp_path):
    out = tmp_path / "REPORT.md"
    out.write_text("my notes\n")

    def runner(section):
        raise AssertionError("no section may run")

    with pytest.raises(ConfigError, match="was not written by gpu_check"):
        gpu_check.main(["--out", str(out)], probe=lambda: FAKE_ENVIRONMENT, runner=runner)
    assert out.read_text() == "my notes\n"
    with pytest.raises(ConfigError, match="no CUDA"):  # the device is checked first of all
        gpu_check.main(["--out", str(tmp_path / "new.md")], runner=runner,
                       probe=lambda: (_ for _ in ()).throw(ConfigError("no CUDA device")))


def test_section_runner_statuses(gpu_check):
    python = sys.executable
    cases = {
        "passed": [python, "-c", "print('hello')"],
        "failed (exit 3)": [python, "-c", "import sys; print('bad'); sys.exit(3)"],
        "timed out after 1 s": [python, "-c", "import time; print('slow', flush=True); time.sleep(30)"],
    }
    for expected, command in cases.items():
        limit = 1 if "timed" in expected else 60
        result = gpu_check.run_section(gpu_check.Section("s", command, timeout_s=limit))
        assert result.status == expected, (expected, result.output)
    assert "hello" in gpu_check.run_section(gpu_check.Section("s", cases["passed"], 60)).output
    missing = gpu_check.run_section(gpu_check.Section("s", ["/nonexistent/program"], 5))
    assert missing.status.startswith("could not start") and not missing.passed


def test_sections_call_the_benchmark_scripts_with_flags_they_accept(gpu_check, monkeypatch):
    """Flag typos would only show on a GPU: parse each command with its script's own parser here (with
    CUDA faked present: bench_wan_step checks --device cuda while parsing)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    sections = {s.name: s for s in gpu_check.default_sections()}
    assert sum(s.timeout_s for s in sections.values()) <= 12.5 * 60
    for name, script in [("operator benchmark", "bench_attention"), ("Wan2.1-1.3B step", "bench_wan_step")]:
        command = sections[name].command
        assert Path(command[1]).is_file() and Path(command[1]).stem == script
        args = load_script(Path(command[1])).parse_args(command[2:])
        assert args.device == "cuda" and args.dtype == "bf16"
    assert sections["gpu tests"].command[1:5] == ["-m", "pytest", "-m", "gpu"]
