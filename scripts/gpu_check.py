"""Every GPU check in one command and one Markdown report, for the few minutes a GPU is lent:

    python scripts/gpu_check.py --out REPORT.md   # 308 s on one H200 (2026-11-28); limits sum to 12.5 min

Sections, each run as its own process with a time limit (a section that fails or runs out of time is
reported with its output and the next one runs; the exit status is 1 when any section did not pass):

1. ``gpu tests``: ``pytest -m gpu`` (the CUDA-only tests: Triton kernels, compile, bf16 training steps);
2. ``profile``: ``profile_mhla.py``: per-kernel GPU time at the model shapes, host vs GPU time per call,
   one Wan2.1-1.3B block split by op;
3. ``operator benchmark``: ``bench_attention.py`` in bf16: the model-shape tables (SDPA with the
   FlashAttention backend, SANA's linear attention, MHLA through PyTorch, the registered op and the Triton
   kernels) for Wan2.1-1.3B at 480p, SANA and DiT; the Wan 480p token grid against an evenly divisible one;
   square grids with SDPA, linear attention and MHLA; each with its peak memory;
4. ``Wan2.1-1.3B step``: ``bench_wan_step.py``: one 480p, 81-frame denoising step with random weights, bf16:
   stock attention vs the MHLA hybrid vs MHLA in every layer, with peak memory per variant.

The report starts with the environment (GPU, driver, CUDA, torch, triton, diffusers, git commit), then a
summary table (status and time per section), then each section's command and the tail of its output. It is
rewritten after every section, so a machine taken back mid-run leaves the sections done so far. Without a
CUDA device the script stops at once with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere: `python scripts/gpu_check.py`

from mhla_gen.cli import run as run_cli  # noqa: E402
from mhla_gen.errors import ConfigError  # noqa: E402
from mhla_gen.folders import check_writable  # noqa: E402
from mhla_gen.locks import writing_files  # noqa: E402
from mhla_gen.train.io import atomic_write_text  # noqa: E402

BENCH_DIR = REPO / "benchmarks"  # where the benchmark scripts live: the one line to change if they move
BENCH_ATTENTION = BENCH_DIR / "bench_attention.py"
BENCH_WAN_STEP = BENCH_DIR / "bench_wan_step.py"
PROFILE = BENCH_DIR / "profile_mhla.py"
REPORT_RECORD = "<!-- mhla_gen: gpu-check report -->"  # first line: the report is ours to replace
OUTPUT_TAIL_LINES = 600  # the profile section prints ~400 lines


@dataclass(frozen=True)
class Section:
    """One check: a command run in the repository root, with its time limit."""

    name: str
    command: list[str]
    timeout_s: int


@dataclass(frozen=True)
class SectionResult:
    name: str
    command: list[str]
    status: str  # "passed", "failed (exit N)", "timed out after N s", "could not start: ..."
    seconds: float
    output: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def default_sections(python: str = sys.executable) -> list[Section]:
    """The four sections, time limits summing to 12.5 minutes."""
    tests = [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", str(REPO / "tests")]
    operator = [python, str(BENCH_ATTENTION), "--device", "cuda", "--dtype", "bf16", "--repeats", "5",
                "--shapes", "wan480", "sana4096", "dit256", "--grids", "21x30x52:3x5x10", "21x30x50:3x5x10",
                "--sizes", "4096", "16384", "65536", "--blocks", "16", "64", "--skip-sdpa-above", "65536"]
    wan_step = [python, str(BENCH_WAN_STEP), "--device", "cuda", "--dtype", "bf16", "--reps", "3"]
    profile = [python, str(PROFILE)]
    return [Section("gpu tests", tests, 300), Section("profile", profile, 150),
            Section("operator benchmark", operator, 120), Section("Wan2.1-1.3B step", wan_step, 180)]


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception as err:  # noqa: BLE001 - a missing or broken package is a fact to report
        return f"unavailable ({type(err).__name__})"


def _command_output(command: list[str]) -> str:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unavailable ({type(err).__name__})"
    return result.stdout.strip() or f"unavailable (exit {result.returncode})"


def cuda_environment() -> dict[str, str]:
    """The report's environment rows. ConfigError (one line, exit 2) when there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("no CUDA device (torch.cuda.is_available() is False): gpu_check runs on a GPU "
                          "machine")
    props = torch.cuda.get_device_properties(0)
    return {
        "GPU": f"{props.name}, {props.total_memory / 2**30:.0f} GiB, compute {props.major}.{props.minor}, "
               f"{torch.cuda.device_count()} visible",
        "driver": _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "CUDA (torch)": str(torch.version.cuda),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "diffusers": _version("diffusers"),
        "python": platform.python_version(),
        "mhla_gen commit": _command_output(["git", "rev-parse", "--short", "HEAD"]),
    }


def run_section(section: Section) -> SectionResult:
    """Run one section's command in the repository root; never raises."""
    paths = [str(REPO), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    start = time.monotonic()
    try:
        result = subprocess.run(section.command, cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=section.timeout_s)
        status = "passed" if result.returncode == 0 else f"failed (exit {result.returncode})"
        output = result.stdout + result.stderr
    except subprocess.TimeoutExpired as err:
        status = f"timed out after {section.timeout_s} s"
        output = "".join(_text(part) for part in (err.stdout, err.stderr))
    except OSError as err:
        status, output = f"could not start: {err}", ""
    return SectionResult(section.name, section.command, status, time.monotonic() - start, output)


def _text(part) -> str:
    return part.decode(errors="replace") if isinstance(part, bytes) else (part or "")


def _tail(text: str, lines: int = OUTPUT_TAIL_LINES) -> str:
    kept = text.rstrip().splitlines()
    cut = len(kept) - lines
    return "\n".join(([f"[... {cut} earlier lines]"] if cut > 0 else []) + kept[-lines:])


def report_markdown(environment: dict[str, str], results: list[SectionResult], planned: list[Section],
                    command: str, started: str) -> str:
    """The whole report: record line, environment, summary, one part per section."""
    done = {r.name for r in results}
    passed = sum(r.passed for r in results)
    lines = [REPORT_RECORD, "# mhla_gen GPU check", "",
             f"{started} · `{command}` · {passed} / {len(planned)} sections passed · "
             f"{sum(r.seconds for r in results):.0f} s", "", "## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in environment.items()]
    lines += ["", "## Summary", "", "| section | status | time |", "|---|---|---:|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.0f} s |" for r in results]
    lines += [f"| {s.name} | not run | |" for s in planned if s.name not in done]
    for r in results:
        lines += ["", f"## {r.name}", "", f"`{shlex.join(r.command)}`", "",
                  f"{r.status} in {r.seconds:.0f} s", "", "```text", _tail(r.output) or "(no output)", "```"]
    return "\n".join(lines) + "\n"


def check_report_target(path: Path, overwrite: bool) -> Path:
    """``--out`` may be new, a report this script wrote, or anything with ``--overwrite``."""
    if path.is_dir():
        raise ConfigError(f"--out={str(path)!r} is a folder; give a file path")
    if path.exists() and not overwrite:
        first = path.read_text(errors="replace").split("\n", 1)[0]
        if first != REPORT_RECORD:
            raise ConfigError(f"--out={str(path)!r} exists and was not written by gpu_check; nothing was "
                              "changed: choose another path, or pass --overwrite")
    check_writable(path, "--out")
    return path


def parse_args(argv=None) -> argparse.Namespace:
    names = [s.name for s in default_sections()]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the Markdown report to write")
    parser.add_argument("--only", nargs="+", choices=names, default=None, help="run only these sections")
    parser.add_argument("--overwrite", action="store_true", help="replace --out even if gpu_check did not "
                        "write it")
    return parser.parse_args(argv)


def main(argv=None, probe: Callable[[], dict] = cuda_environment,
         runner: Callable[[Section], SectionResult] = run_section) -> int:
    """Check the device and ``--out``, run the sections, write the report after each; 0 if all passed."""
    args = parse_args(argv)
    environment = probe()  # before anything is written: no CUDA, no report
    out = check_report_target(args.out.expanduser(), args.overwrite)
    with writing_files((out, "--out")):  # one writer per file (a second one stops, naming this pid)
        return _run_sections(args, argv, environment, out, runner)


def _run_sections(args, argv, environment: dict, out: Path, runner) -> int:
    """Run the planned sections, writing the report to ``out`` after each (its lock held by the caller)."""
    planned = [s for s in default_sections() if args.only is None or s.name in args.only]
    command = shlex.join(["python", "scripts/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = []
    for section in planned:
        print(f"gpu_check: {section.name} (limit {section.timeout_s} s) ...", file=sys.stderr, flush=True)
        results.append(runner(section))
        print(f"gpu_check: {section.name}: {results[-1].status}", file=sys.stderr, flush=True)
        atomic_write_text(out, report_markdown(environment, results, planned, command, started))
    print(f"gpu_check: {sum(r.passed for r in results)} / {len(results)} sections passed; report in {out}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    run_cli(lambda: sys.exit(main()))
