r"""Every GPU check in one command and one Markdown report, for a few minutes on one GPU.

    python scripts/gpu_check.py --out REPORT.md             # at most 7 minutes on one H200 (--budget-s 420)
    python scripts/gpu_check.py --out REPORT.md --dry-run   # every section's plumbing on CPU (tiny sizes)

The GPU machine has torch, triton, accelerate, transformers and the rest, but not diffusers 0.42.1, omegaconf
2.4.0, clean-fid, ftfy, wcwidth, importlib_metadata, and no network. Download their wheels here (into the
git-ignored ``.whl/``), then install them there before the check (``scripts/gpu_wheels.sh`` has the list):

    bash scripts/gpu_wheels.sh                                                        # here, with network
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site                                               # there, before the check

Sections, in this order, each its own process with a time limit (a section that fails or runs out of time is
reported with its output and the next one runs):

1. ``kernel tests``: ``pytest -m gpu`` on the kernel files (Triton kernels against the oracle, the op on
   CUDA). If they fail or run out of time, every benchmark below (they trust the kernels) is reported as
   not run;
2. ``profile``: ``benchmarks/profile_mhla.py``: per-kernel GPU time at the model shapes, host vs GPU time
   per call, one Wan2.1-1.3B block split by op (the report keeps its whole output);
3. ``CUDA graphs``: ``bench_attention.py --cuda-graphs``: FlashAttention, linear attention and MHLA eager
   beside the same calls replayed from CUDA graphs (the GPU's time alone) at the model shapes and at
   N = 256 to 16384 (DiT-XL/2 heads, 4x4 blocks);
4. ``small-N crossover``: the same for FlashAttention and MHLA by N, and the N from which MHLA is faster;
5. ``tile sweep``: ``benchmarks/tune_mhla_tiles.py`` when it exists (``--skip-tiles`` leaves it out), its
   table written into the folder beside the report (``REPORT.files/mhla_tiles.json``);
6. ``Wan2.1-1.3B step``: ``bench_wan_step.py``: one 480p, 81-frame step, stock / hybrid / all MHLA, eager;
7. ``DiT-XL/2 training step``: ``bench_dit_step.py``: batch 32, bf16 autocast, AdamW, softmax vs MHLA;
8. ``SANA-1.6B 1024 px step``: ``bench_sana_step.py``: stock linear attention vs MHLA, inference;
9. ``host overhead``: ``bench_host_overhead.py``: host time per MHLA call, layer by layer;
10. ``Wan2.1-1.3B step, compiled`` and 11. ``other gpu tests`` (compile, CUDA graphs of whole models, bf16
    training steps): only when the time budget still holds their whole limit;
12. ``kernel check``, 13. ``scale-study sizing``, 14. ``scale study`` (N >> M², ``eval/scale_study.py``) and
    15. ``dense kernel check``: the bf16 kernel tests against the oracle on the blocked path, the one the
    study trains with, those at the study's own shapes first (about a minute; the study is not run if
    they fail or run out of time; left out when ``kernel tests``, which include them, passed earlier in
    the same run), the training and forward images/s of softmax, MHLA and linear attention at 1024 then
    4096 tokens (about 30 s; written to ``scale_sizing.json`` beside the report after every row), then
    the study sized by it: the three arms x 3 seeds at 4096 then 1024 tokens (a grid the sizing cannot
    size is left out, the other runs), 100 s of the device per grid for training and evaluations
    (within the section's 300 s with start-up; it still starts with 180 s left, which hold its first
    grid), its record and tables in ``scale_study/`` beside the
    report (``record.npz``, ``scale_study.md``; a study stopped early keeps every point finished by
    then), and last the dense path's bf16 tests (reported, no gate: the study does not run that path).
    Optional: a default run leaves them out (the benchmarks fill its budget); the study runs only after
    its sizing wrote its file. On a lent machine, whose ``$OUT`` is what comes back, with the wheels
    carried in ``.whl/``:

        python scripts/gpu_check.py --out "$OUT/REPORT.md" --budget-s 515 \
            --only "kernel check" "scale-study sizing" "scale study" "dense kernel check"

16. ``stream study on cuda`` (``eval/stream_study.py --device cuda``, issue 58): the streaming study's four
    arms, one seed, 100 training steps at batch 32 and 10 streamed videos, then memory and time per chunk
    on the GPU: its CUDA path end to end, and the seconds a training step takes there (each arm prints
    them), which size the 6000-step run. Optional; its folder comes back beside the report
    (``stream_sizing/``):

        python scripts/gpu_check.py --out "$OUT/REPORT.md" --only "stream study on cuda"

Time: ``--budget-s`` (420) caps the whole run: a section's limit is cut to the time left less 35 s (what
stopping it may take), a section that would get less than 20 s is not run, and the optional sections run
only when their whole limit fits. A section past its limit gets Ctrl-C (SIGINT to its process group) and
30 s to keep what it finished (the scale study writes the record of its finished points), then SIGKILL
(and 5 s to end): the whole run ends within the budget, so give a caller's own time limit the budget plus
the environment probe before it (a few seconds; a minute at most). A check that is killed itself takes
its running section with it (the section dies with it).

The report starts with the environment (GPU, driver, CUDA, torch, triton, diffusers, git commit, copy
bandwidth), then a summary table (status and time per section), then each section's command and the tail of
its output; each section's whole output is also a file in the folder beside the report (``REPORT.files/``
for ``REPORT.md``, marked as ours; its path is ``$GPU_CHECK_OUT`` in the sections' environment, for scripts
that write more files). A section's output goes into its file as it runs (Python's unbuffered), and the
report is rewritten when a section starts, every 15 s while it runs (a ``running`` row with the output so
far) and after it ends, so a machine taken back mid-run, or a caller's time limit, leaves what was done and
printed until then. Exit status 0 when every section that ran passed and no required one was left out.
Without a CUDA device the real run stops at once with one line and exit status 2; ``--dry-run`` runs each
section's CPU plumbing instead (tiny sizes, ``--help``, test collection).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere: `python scripts/gpu_check.py`

from mhla_gen.commands.cli import run as run_cli  # noqa: E402
from mhla_gen.errors import ConfigError  # noqa: E402
from mhla_gen.outputs.folders import check_writable, claim, record_files  # noqa: E402
from mhla_gen.outputs.locks import writing_files  # noqa: E402
from mhla_gen.train.io import atomic_write_text  # noqa: E402

BENCH_DIR = REPO / "benchmarks"  # where the benchmark scripts live: the one line to change if they move
TESTS = REPO / "tests"
KERNEL_TEST_FILES = [TESTS / "test_triton_mhla.py", TESTS / "test_ops.py"]
REPORT_RECORD = "<!-- mhla_gen: gpu-check report -->"  # first line: the report is ours to replace
OUTPUTS_KIND = "gpu_check"  # the folder beside the report (mhla_gen.outputs.folders.KINDS)
OUTPUT_TAIL_LINES = 80  # per section in the report; the whole output is in the folder beside it
MIN_SECTION_S = 20  # a section that would get less time than this is not started
STOP_GRACE_S = 30  # a section past its limit gets Ctrl-C, then this long to keep what it finished
KILL_WAIT_S = 5  # then SIGKILL, and this long for it to end
STOP_RESERVE_S = STOP_GRACE_S + KILL_WAIT_S  # kept out of every section's limit: a stop ends in the budget
PROGRESS_S = 15  # the report is rewritten this often while a section runs
OUTPUTS = "{outputs}"  # in a section's arguments: the folder beside the report (outputs_folder)
TILE_TABLE = "mhla_tiles.json"  # the tile sweep's table, written into that folder
DEFAULT_BUDGET_S = 420
DRY_RUN_LIMIT_S = 300  # per section with --dry-run (CPU; process start-up alone takes seconds)


@dataclass(frozen=True)
class Section:
    """One check: a command run in the repository root, with its time limit.

    ``dry_command``: what ``--dry-run`` runs instead (CPU, tiny sizes, or ``--help``); ``trusts_kernels``:
    not run when a gate did not pass; ``gate``: kernel tests (if they fail, run out of time or cannot
    start, the ``trusts_kernels`` sections are not run); ``optional``: runs only when the budget still
    holds ``timeout_s``, or ``shortest_s`` where given (its limit is then what is left: a section that
    keeps what it finished when stopped); ``whole_output``: the report keeps all of it;
    ``needs_file``: not run while this file does not exist (a script still being written); ``needs_output``:
    not run while the outputs folder lacks this file (an earlier section writes it); ``writes``: the
    files the command writes into the outputs folder (``{outputs}`` in its arguments), listed after it;
    ``covered_by``: not run when that section passed earlier in the same run (its tests include these)."""

    name: str
    command: list[str]
    timeout_s: int
    dry_command: list[str] | None = None
    trusts_kernels: bool = True
    gate: bool = False
    optional: bool = False
    shortest_s: int | None = None
    whole_output: bool = False
    needs_file: Path | None = None
    needs_output: str | None = None
    writes: tuple[str, ...] = ()
    covered_by: str | None = None


@dataclass(frozen=True)
class SectionResult:
    name: str
    command: list[str]
    status: str  # "passed", "failed (exit N)", "timed out after N s", "could not start: ...", "not run (...)"
    seconds: float
    output: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def ran(self) -> bool:
        return not self.status.startswith("not run")


def _bench(python: str, script: str, *args: str) -> list[str]:
    return [python, str(BENCH_DIR / script), *args]


def _gpu_pytest(python: str) -> list[str]:
    """``pytest`` on the ``gpu``-marked tests, quiet, writing no cache into the checkout."""
    return [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]


def default_sections(python: str = sys.executable, skip_tiles: bool = False) -> list[Section]:
    """The sections in their order (see the module docstring)."""
    pytest = _gpu_pytest(python)
    kernel_files = [str(f) for f in KERNEL_TEST_FILES]
    other_tests = [str(TESTS), *(f"--ignore={f}" for f in kernel_files)]
    graphs = ["--device", "cuda", "--dtype", "bf16", "--cuda-graphs", "--repeats", "5"]
    tiny_graphs = ["--device", "cpu", "--cuda-graphs", "--repeats", "1", "--graph-shape", "1", "2", "8",
                   "--threads", "1"]
    wan = ["--device", "cuda", "--dtype", "bf16", "--reps", "3"]
    tiny_wan = ["--tiny", "--frames", "5", "--height", "32", "--width", "48", "--batch", "1", "--reps", "1",
                "--device", "cpu", "--threads", "1"]
    tiny_step = ["--tiny", "--device", "cpu", "--batch", "1", "--reps", "1", "--warmup", "1",
                 "--threads", "1"]
    cuda_step = ["--device", "cuda", "--reps", "5"]
    tiles = BENCH_DIR / "tune_mhla_tiles.py"
    sections = [
        Section("kernel tests", [*pytest, *kernel_files], 200, [*pytest, "--collect-only", *kernel_files],
                trusts_kernels=False, gate=True),
        Section("profile", _bench(python, "profile_mhla.py"), 75, _bench(python, "profile_mhla.py", "--help"),
                whole_output=True),
        Section("CUDA graphs", _bench(python, "bench_attention.py", *graphs, "--crossover-sizes"), 90,
                _bench(python, "bench_attention.py", *tiny_graphs, "--shapes", "--graph-sizes", "16",
                       "--crossover-sizes")),
        Section("small-N crossover",
                _bench(python, "bench_attention.py", *graphs, "--shapes", "--graph-sizes"),
                45, _bench(python, "bench_attention.py", *tiny_graphs, "--shapes", "--graph-sizes",
                           "--crossover-sizes", "16", "64")),
        Section("tile sweep", [python, str(tiles), "--out", f"{OUTPUTS}/{TILE_TABLE}"], 60,
                [python, str(tiles), "--list", "--device", "cpu"], needs_file=tiles, writes=(TILE_TABLE,)),
        Section("Wan2.1-1.3B step", _bench(python, "bench_wan_step.py", *wan), 75,
                _bench(python, "bench_wan_step.py", *tiny_wan)),
        Section("DiT-XL/2 training step", _bench(python, "bench_dit_step.py", *cuda_step), 75,
                _bench(python, "bench_dit_step.py", *tiny_step)),
        Section("SANA-1.6B 1024 px step", _bench(python, "bench_sana_step.py", *cuda_step), 50,
                _bench(python, "bench_sana_step.py", *tiny_step)),
        Section("host overhead", _bench(python, "bench_host_overhead.py", "--device", "cuda"), 45,
                _bench(python, "bench_host_overhead.py", "--device", "cpu", "--reps", "2", "--calls", "2")),
        Section("Wan2.1-1.3B step, compiled", _bench(python, "bench_wan_step.py", *wan, "--compile"), 150,
                _bench(python, "bench_wan_step.py", "--compile", "--help"), optional=True),
        Section("other gpu tests", [*pytest, *other_tests], 150, [*pytest, "--collect-only", *other_tests],
                trusts_kernels=False, optional=True),
        *scale_study_sections(python),
        stream_study_section(python),
    ]
    return [s for s in sections if not (skip_tiles and s.name == "tile sweep")]


SCALE_STUDY = REPO / "eval" / "scale_study.py"
SIZING_FILE = "scale_sizing.json"  # the sizing section's measurements, read by the study section
STUDY_FOLDER = "scale_study"  # the study's record and tables (eval/scale_study.py --export)
# The study section: 2 grids x 100 s of the device for training and evaluations (the validation loss at
# every point, samples at two; eval/scale_study.py counts them from the sizing's forward speed), then
# 9 processes' start-up per grid; the sizing: 6 timed rows and their kernels' first compiles.
STUDY_LIMIT_S = 300
STUDY_SECONDS_PER_GRID = 100
# The study still starts with this much left: its first grid (4096 tokens) with its start-ups; stopped at
# its limit it keeps every finished point, so a slow kernel check or sizing costs the 1024 grid, not both.
STUDY_SHORTEST_S = 180
SIZING_LIMIT_S = 120
KERNEL_CHECK_LIMIT_S = 90  # 8 bf16 oracle tests (2 at the study's shapes), each first compile included
DENSE_CHECK_LIMIT_S = 60  # 6 bf16 oracle tests of the dense path, each first compile included

# The kernel check: the blocked Triton path in bf16 (the study's: its 1024 and 4096 tokens are past the
# dense path's), the tests at the study's own shapes first, so that a time limit cuts the others. The
# dense path's bf16 tests are their own section, after the study: the study does not run that path.
_ORACLE_TESTS = str(KERNEL_TEST_FILES[0]) + "::test_cuda_matches_oracle"
KERNEL_CHECK = [_ORACLE_TESTS + "_at_the_scale_study_shapes", _ORACLE_TESTS, "-k", "bfloat16 and not dense"]
DENSE_CHECK = [_ORACLE_TESTS, "-k", "bfloat16 and dense"]


def scale_study_sections(python: str) -> list[Section]:
    """``eval/scale_study.py`` (MHLA / softmax / linear at 1024 and 4096 tokens): a short kernel check of
    the path the study trains with (the blocked Triton kernels in bf16: if that fails or runs out of time,
    the study is not run), its sizing (images/s per arm and N, about 30 s; 1024 tokens first, written
    row by row), the study sized by it (4096 tokens first), then the dense path's bf16 tests (reported,
    no gate: the study does not run that path); optional (a run names them with ``--only``); the study's
    record and tables come back in the folder beside the report."""
    script, sizing = [python, str(SCALE_STUDY)], f"{OUTPUTS}/{SIZING_FILE}"
    export = ["--export", f"{OUTPUTS}/{STUDY_FOLDER}"]
    pytest = _gpu_pytest(python)
    grids = ["--grids", "1024", "4096"]  # the sizing: a 4096 row that fails keeps the 1024 rows
    return [
        Section("kernel check", [*pytest, *KERNEL_CHECK], KERNEL_CHECK_LIMIT_S,
                [*pytest, "--collect-only", *KERNEL_CHECK], trusts_kernels=False, gate=True, optional=True,
                covered_by="kernel tests"),  # a subset of them: run when they did not run before it
        Section("scale-study sizing",
                [*script, "--sizing-only", "--sizing", sizing, *grids, "--sizing-seconds", "2"],
                SIZING_LIMIT_S,
                [*script, "--smoke", "--sizing-only", "--sizing", sizing, "--sizing-seconds", "0.2"],
                optional=True, writes=(SIZING_FILE,)),
        Section("scale study",
                [*script, "--sizing", sizing, "--grids", "4096", "1024", "--seconds",
                 str(STUDY_SECONDS_PER_GRID), *export],
                STUDY_LIMIT_S, [*script, "--smoke", *export], optional=True, shortest_s=STUDY_SHORTEST_S,
                needs_output=SIZING_FILE,
                writes=(f"{STUDY_FOLDER}/record.npz", f"{STUDY_FOLDER}/scale_study.md")),
        Section("dense kernel check", [*pytest, *DENSE_CHECK], DENSE_CHECK_LIMIT_S,
                [*pytest, "--collect-only", *DENSE_CHECK], trusts_kernels=False, optional=True,
                covered_by="kernel tests"),
    ]


STREAM_STUDY = REPO / "eval" / "stream_study.py"
STREAM_FOLDER = "stream_sizing"  # the stream study's records, costs and page (beside the report)


def stream_study_section(python: str) -> Section:
    """``eval/stream_study.py`` on CUDA at its main size for 100 steps, one seed: the path a GPU run of the
    streaming study takes, and its seconds per training step; optional."""
    script = [python, str(STREAM_STUDY), "--out", f"{OUTPUTS}/{STREAM_FOLDER}", "--seeds", "1"]
    sized = ["--steps", "100", "--batch", "32", "--eval-clips", "10", "--device", "cuda"]
    return Section("stream study on cuda", [*script, *sized], 120, [*script, "--size", "smoke"],
                   optional=True, writes=(f"{STREAM_FOLDER}/costs.json", f"{STREAM_FOLDER}/record.npz",
                                          f"{STREAM_FOLDER}/streaming.md"))


# --------------------------------------------------------------------------------------------------
# the environment


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


def _software() -> dict[str, str]:
    import torch

    return {
        "CUDA (torch)": str(torch.version.cuda),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "diffusers": _version("diffusers"),
        "python": platform.python_version(),
        "mhla_gen commit": _command_output(["git", "rev-parse", "--short", "HEAD"]),
    }


def copy_bandwidth_gbs(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth (read + write of ``nbytes``) in GB/s: median of 5 samples of 10."""
    import torch

    src = torch.empty(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(5):
        start.record()
        for _ in range(10):
            dst.copy_(src)
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end) / 10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (statistics.median(ms) * 1e-3) / 1e9


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
        **_software(),
        "copy bandwidth": f"{copy_bandwidth_gbs():.0f} GB/s (device to device, 1 GiB, read + write)",
    }


def dry_environment() -> dict[str, str]:
    """``--dry-run``: the software rows; no device is used."""
    return {"GPU": "none (dry run: CPU plumbing only)", **_software()}


# --------------------------------------------------------------------------------------------------
# running the sections


def run_section(section: Section, timeout_s: float | None = None, outputs: Path | None = None,
                log: Path | None = None, progress: Callable[[float, str], None] | None = None
                ) -> SectionResult:
    """Run one section's command in the repository root; never raises. ``outputs`` becomes
    ``$GPU_CHECK_OUT`` for the command. Its output goes to ``log`` as it runs (after a first line with the
    command: :func:`running_header`; default a temporary file), Python's unbuffered, so what it printed
    is on disk if this script is killed; ``progress(seconds, output so far)`` every :data:`PROGRESS_S`
    while it runs. The section runs in its own process group (stopped as a whole, its workers with it)
    and dies with this script (:data:`SECTION_START`)."""
    limit = section.timeout_s if timeout_s is None else timeout_s
    paths = [str(REPO), os.environ.get("PYTHONPATH")]
    env = {"PYTHONUNBUFFERED": "1", **os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    if outputs is not None:
        env["GPU_CHECK_OUT"] = str(outputs)
    if shutil.which(section.command[0]) is None:
        return SectionResult(section.name, section.command, f"could not start: no program "
                             f"{section.command[0]!r}", 0.0, "")
    with contextlib.ExitStack() as stack:
        if log is None:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "output.txt"
        header = running_header(section)
        Path(log).write_text(header, encoding="utf-8")
        skip = len(header.encode("utf-8"))
        sink = stack.enter_context(open(log, "ab"))  # appending: the child writes at the end, always
        start = time.monotonic()
        try:
            process = subprocess.Popen([sys.executable, "-c", SECTION_START, str(os.getpid()),
                                        *section.command], cwd=REPO, env=env, stdout=sink,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as err:
            return SectionResult(section.name, section.command, f"could not start: {err}", 0.0, "")
        tick = None if progress is None else (lambda seconds: progress(seconds, _read_from(log, skip)))
        try:
            status = _wait(process, limit, tick)
        finally:
            _signal_group(process, signal.SIGKILL)  # whatever the section left running
        return SectionResult(section.name, section.command, status, time.monotonic() - start,
                             _read_from(log, skip))


def running_header(section: Section) -> str:
    """The first lines of a section's output file while it runs; :func:`output_text` replaces them."""
    return _output_file(section.command, "running (its status is written here when it ends)", "")


def output_text(result: SectionResult) -> str:
    """A section's output file once it has ended: its command, its status, its whole output."""
    return _output_file(result.command, result.status, result.output)


def _output_file(command: list[str], status: str, output: str) -> str:
    return f"$ {shlex.join(command)}\n{status}\n\n{output}"


def _read_from(path: Path, offset: int) -> str:
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read().decode("utf-8", errors="replace")


def _wait(process: subprocess.Popen, limit: float, tick: Callable[[float], None] | None) -> str:
    """The section's status once it ends, or once past ``limit`` it is stopped (:func:`_stop`);
    ``tick(seconds)`` every :data:`PROGRESS_S` meanwhile."""
    start = time.monotonic()
    while True:
        left = limit - (time.monotonic() - start)
        if left <= 0:
            _stop(process)
            return f"timed out after {limit:.0f} s"
        try:
            code = process.wait(timeout=min(PROGRESS_S, left))
        except subprocess.TimeoutExpired:
            if tick is not None:
                tick(time.monotonic() - start)
            continue
        return "passed" if code == 0 else f"failed (exit {code})"


# What a section's process runs before its command (no preexec_fn: this script holds CUDA's threads by
# then): Ctrl-C at its default, also when this script was started with SIGINT ignored (a background job of
# a non-interactive shell passes that on), and SIGKILL when this script dies (prctl PR_SET_PDEATHSIG, kept
# across exec), so a check that is itself killed leaves no section running on the device. The prctl lines
# are mhla_gen.outputs.locks.die_with_parent's, written out: importing it loads the package (torch,
# diffusers: seconds) before every section.
SECTION_START = """import ctypes, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != int(sys.argv[1]):
        os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _stop(process: subprocess.Popen) -> None:
    """Ctrl-C to a section past its limit, so that it can keep what it finished (the scale study writes
    the record of its finished points; pytest prints its summary); SIGKILL to its group after
    :data:`STOP_GRACE_S`, and to its process :data:`KILL_WAIT_S` after that."""
    _signal_group(process, signal.SIGINT)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        try:
            process.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):  # the group has ended
        pass


def _tail(text: str, lines: int | None = OUTPUT_TAIL_LINES) -> str:
    kept = text.rstrip().splitlines()
    if lines is None:
        return "\n".join(kept)
    cut = len(kept) - lines
    return "\n".join(([f"[... {cut} earlier lines]"] if cut > 0 else []) + kept[-lines:])


def skip_reason(section: Section, remaining_s: float, gate_failed: str | None = None,
                outputs: Path | None = None, passed: frozenset[str] = frozenset()) -> str | None:
    """Why ``section`` does not run now (None: it runs); ``remaining_s``: the budget left, of which
    :data:`STOP_RESERVE_S` is kept for a stop; ``gate_failed``: the kernel-test section that did not pass
    and its status (:func:`gate_failure`); ``outputs``: the folder beside the report; ``passed``: the
    sections that passed so far in this run."""
    if gate_failed and section.trusts_kernels:
        return f"not run (the kernel tests did not pass: {gate_failed})"
    if section.covered_by in passed:
        return f"not run ({section.covered_by} passed in this run: its tests include these)"
    if section.needs_file is not None and not section.needs_file.is_file():
        return f"not run ({section.needs_file.relative_to(REPO)} does not exist)"
    if section.needs_output is not None and not (outputs and (outputs / section.needs_output).is_file()):
        return f"not run (no {section.needs_output} beside the report: its section did not write it)"
    needed = (section.shortest_s or section.timeout_s) if section.optional else MIN_SECTION_S
    if remaining_s - STOP_RESERVE_S < needed:
        return (f"not run (time budget: {remaining_s:.0f} s left, {needed} s needed and {STOP_RESERVE_S} s "
                "for a stop)")
    return None


def section_limit(section: Section, remaining_s: float) -> float:
    """A section's time limit: its own, cut so that a stop at the limit (:data:`STOP_RESERVE_S`) still
    ends within the budget left."""
    return min(section.timeout_s, remaining_s - STOP_RESERVE_S)


def gate_failure(section: Section, result: SectionResult) -> str | None:
    """``"<name> <status>"`` when ``section`` is a kernel-test gate that did not pass (failed, timed out
    or could not start): the sections that trust the kernels are not run; None otherwise."""
    if section.gate and result.ran and not result.passed:
        return f"{section.name} {result.status}"
    return None


def excused(section: Section) -> bool:
    """Whether leaving ``section`` out is no failure: an optional one, or one whose script does not exist
    yet."""
    return section.optional or (section.needs_file is not None and not section.needs_file.is_file())


def output_file_name(index: int, section: Section) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in section.name.lower()).strip("-")
    return f"{index:02d}-{'-'.join(filter(None, slug.split('-')))}.txt"


# --------------------------------------------------------------------------------------------------
# the report


def report_markdown(environment: dict[str, str], results: list[SectionResult], planned: list[Section],
                    command: str, started: str, files: dict[str, str] | None = None) -> str:
    """The whole report: record line, environment, summary, one part per section."""
    files = files or {}
    done = {r.name for r in results}
    whole = {s.name for s in planned if s.whole_output}
    passed = sum(r.passed for r in results)
    lines = [REPORT_RECORD, "# mhla_gen GPU check", "",
             f"{started} · `{command}` · {passed} / {len(planned)} sections passed · "
             f"{sum(r.seconds for r in results):.0f} s", "", "## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in environment.items()]
    lines += ["", "## Summary", "", "| section | status | time |", "|---|---|---:|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.0f} s |" if r.ran else f"| {r.name} | {r.status} | |"
              for r in results]
    lines += [f"| {s.name} | not run | |" for s in planned if s.name not in done]
    for r in results:
        if not r.ran:
            continue
        where = f" · whole output: `{files[r.name]}`" if r.name in files else ""
        tail = _tail(r.output, None if r.name in whole else OUTPUT_TAIL_LINES)
        lines += ["", f"## {r.name}", "", f"`{shlex.join(r.command)}`", "",
                  f"{r.status} in {r.seconds:.0f} s{where}", "", "```text", tail or "(no output)", "```"]
    return "\n".join(lines) + "\n"


def check_report_target(path: Path, overwrite: bool) -> Path:
    """``--out`` may be new, a report this script wrote, or anything with ``--overwrite``."""
    if path.is_dir():
        raise ConfigError(f"--out={str(path)!r} is a folder; give a file path")
    if not path.parent.is_dir():
        raise ConfigError(f"--out={str(path)!r}: its folder {str(path.parent)!r} does not exist")
    if path.exists() and not overwrite:
        first = path.read_text(errors="replace").split("\n", 1)[0]
        if first != REPORT_RECORD:
            raise ConfigError(f"--out={str(path)!r} exists and was not written by gpu_check; nothing was "
                              "changed: choose another path, or pass --overwrite")
    check_writable(path, "--out")
    return path


def outputs_folder(out: Path) -> Path:
    """The folder of the sections' whole outputs beside ``out``: ``REPORT.files`` for ``REPORT.md``."""
    return out.with_name(out.stem + ".files")


def parse_args(argv=None) -> argparse.Namespace:
    names = [s.name for s in default_sections()]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the Markdown report to write")
    parser.add_argument("--only", nargs="+", choices=names, default=None, help="run only these sections")
    parser.add_argument("--skip-tiles", action="store_true", help="leave the tile sweep out")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"time budget of the whole run in seconds (default {DEFAULT_BUDGET_S}; with "
                             "--dry-run none)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run every section's CPU plumbing (tiny sizes, --help, test collection)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out even if gpu_check did not "
                        "write it")
    args = parser.parse_args(argv)
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if args.budget_s is None:
        args.budget_s = float("inf") if args.dry_run else DEFAULT_BUDGET_S
    return args


def main(argv=None, probe: Callable[[], dict] | None = None,
         runner: Callable[..., SectionResult] = run_section) -> int:
    """Check the device and ``--out``, run the sections, write the report after each; 0 if all passed."""
    args = parse_args(argv)
    probe = probe or (dry_environment if args.dry_run else cuda_environment)
    environment = probe()  # before anything is written: no CUDA, no report
    out = check_report_target(args.out.expanduser(), args.overwrite)
    with writing_files((out, "--out")):  # one writer per file (a second one stops, naming this pid)
        folder = claim(outputs_folder(out), OUTPUTS_KIND, "--out")
        return _run_sections(args, argv, environment, out, folder, runner)


def _run_sections(args, argv, environment: dict, out: Path, folder: Path, runner) -> int:
    """Run the planned sections, writing the report to ``out`` (and each whole output into ``folder``)
    as each runs and after it; the caller holds the locks."""
    planned = [s for s in default_sections(skip_tiles=args.skip_tiles)
               if args.only is None or s.name in args.only]
    if args.dry_run:  # CPU plumbing: slower machines, so the limits are generous
        planned = [dataclasses.replace(s, command=s.dry_command, timeout_s=max(s.timeout_s, DRY_RUN_LIMIT_S))
                   for s in planned]
    command = shlex.join(["python", "scripts/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    start = time.monotonic()
    results, files, gate_failed = [], {}, None

    def write_report(running: SectionResult | None = None) -> None:
        shown = results + ([running] if running is not None else [])
        atomic_write_text(out, report_markdown(environment, shown, planned, command, started, files))

    for index, section in enumerate(planned, 1):
        remaining = args.budget_s - (time.monotonic() - start)
        passed = frozenset(r.name for r in results if r.passed)
        reason = skip_reason(section, remaining, gate_failed, folder, passed)
        if reason is not None:
            results.append(SectionResult(section.name, section.command, reason, 0.0, ""))
        else:
            section = dataclasses.replace(section, command=[a.replace(OUTPUTS, str(folder))
                                                            for a in section.command])
            limit = section_limit(section, remaining)
            print(f"gpu_check: {section.name} (limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
            result = _run_one(section, output_file_name(index, section), limit, folder, runner, files,
                              write_report)
            results.append(result)
            gate_failed = gate_failed or gate_failure(section, result)
        print(f"gpu_check: {section.name}: {results[-1].status}", file=sys.stderr, flush=True)
        write_report()
    left_out = [r for r, s in zip(results, planned) if not r.ran and not excused(s)]
    print(f"gpu_check: {sum(r.passed for r in results)} / {len(results)} sections passed; report in {out}")
    return 0 if all(r.passed for r in results if r.ran) and not left_out else 1


def _run_one(section: Section, name: str, limit: float, folder: Path, runner, files: dict[str, str],
             write_report: Callable[..., None]) -> SectionResult:
    """Run one section with ``runner``, its output streaming into ``folder / name`` (listed as ours before
    it starts) and the report rewritten as it runs (a "running" row with the output so far); the file
    then holds its command, status and whole output (:func:`output_text`)."""
    record_files(folder, name, pending=True)
    files[section.name] = f"{folder.name}/{name}"

    def progress(seconds: float, output: str) -> None:
        write_report(SectionResult(section.name, section.command, f"running ({seconds:.0f} s so far)",
                                   seconds, output))

    progress(0.0, "")
    result = runner(section, limit, folder, log=folder / name, progress=progress)
    atomic_write_text(folder / name, output_text(result))
    record_files(folder, name, *(f for f in section.writes if (folder / f).is_file()))
    return result


if __name__ == "__main__":
    run_cli(lambda: sys.exit(main()))
