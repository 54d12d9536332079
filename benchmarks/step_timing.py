"""What ``bench_dit_step.py`` and ``bench_sana_step.py`` share: their command line, the interleaved timing
of whole model steps (``bench_wan_step.py`` times its variants with it too), the report and its Markdown
table. Each script keeps its model, its inputs, its step and a :class:`StepBench` naming what differs
(defaults, help, the precision option, the table's words).

Every repetition runs each variant's step once, starting at a rotating variant, so drift of the machine
(clocks, temperature, other processes) hits all variants alike; on CUDA the device is synchronised before
and after each timed step. Results are medians of the samples and medians of per-repetition ratios.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mhla_gen.commands.cli import device_setting
from mhla_gen.errors import ConfigError


@dataclass(frozen=True)
class StepBench:
    """What one step benchmark's command line and table say; the rest of them is this module's."""

    script: str  # its file in benchmarks/, for the table's Command: line
    step: str  # what is timed, in the table's first line
    reference: str  # the variant every speed-up is over
    batch: int  # --batch's default
    batch_help: str
    tiny_help: str
    precision: str  # the option naming the precision ("--mixed-precision", "--dtype")
    precision_choices: tuple[str, ...]
    precision_help: str
    precision_default: tuple[str, str]  # (on CUDA, elsewhere)
    precision_label: str = "{}"  # how the table's first line names the precision
    min_warmup: int = 0  # the fewest --warmup steps
    warmup_why: str = ""  # why that many, in the refusal
    ms_digits: int = 2  # decimals of the ms column
    images_column: bool = False  # an images/s column (batch over the median step)

    @property
    def precision_dest(self) -> str:
        return self.precision.lstrip("-").replace("-", "_")


# ------------------------------------------------------------------------------------------ command line
def parse_step_args(bench: StepBench, description: str, argv=None) -> argparse.Namespace:
    """The step benchmarks' options, checked; ``args.device`` a ``torch.device``, the precision resolved."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=bench.batch, help=bench.batch_help)
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (both models in each)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument(bench.precision, choices=bench.precision_choices, default=None,
                        help=bench.precision_help)
    parser.add_argument("--compile", action="store_true", help="torch.compile both models (inductor)")
    parser.add_argument("--tiny", action="store_true", help=bench.tiny_help)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    for name in ("batch", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < bench.min_warmup:
        need = f"be at least {bench.min_warmup}{bench.warmup_why}" if bench.min_warmup else "not be negative"
        parser.error(f"--warmup must {need}, got {args.warmup}")
    try:
        args.device = device_setting(args.device)
    except ConfigError as error:
        parser.error(str(error))
    on_cuda, elsewhere = bench.precision_default
    default = on_cuda if args.device.type == "cuda" else elsewhere
    setattr(args, bench.precision_dest, getattr(args, bench.precision_dest) or default)
    return args


def step_main(bench: StepBench, args: argparse.Namespace, argv, run: Callable[[argparse.Namespace], dict]
              ) -> dict:
    """``run(args)`` under ``--threads`` (torch's thread count restored after), its table printed."""
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", f"benchmarks/{bench.script}", *given])
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = run(args)
    finally:
        torch.set_num_threads(threads)
    print(markdown(bench, report, args, command))
    return report


# ------------------------------------------------------------------------------------------ timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_seconds(steps: dict[str, Callable[[], object]], reps: int, warmup: int,
                        device: torch.device) -> tuple[dict[str, list[float]], dict[str, float | None]]:
    """``({variant: seconds per timed step}, {variant: peak GiB during its warm-up, CUDA only})``."""
    names = list(steps)
    peak = {name: None for name in names}
    for name in names:  # warm-up: compiles, optimizer states, allocator
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(warmup):
            steps[name]()
        sync(device)
        if device.type == "cuda":
            peak[name] = torch.cuda.max_memory_allocated(device) / 2**30
    seconds = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            sync(device)
            start = time.perf_counter()
            steps[name]()
            sync(device)
            seconds[name].append(time.perf_counter() - start)
    return seconds, peak


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median of the per-repetition ratios ``numerator[i] / denominator[i]``."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"cpu ({torch.get_num_threads()} threads)"


def timed_report(bench: StepBench, steps: dict[str, Callable[[], object]], args, model: str,
                 config: dict) -> dict:
    """Time ``steps`` (``{variant: one step}``, in the table's order) as :func:`interleaved_seconds` does;
    per variant the median ms, images/s (``bench.images_column``), the speed-up over ``bench.reference``
    and the warm-up's peak GiB, with the model's name, config, token count and the device."""
    seconds, peak = interleaved_seconds(steps, args.reps, args.warmup, args.device)
    rows = {}
    for name, samples in seconds.items():
        median_s = statistics.median(samples)
        images = dict(images_s=args.batch / median_s) if bench.images_column else {}
        rows[name] = dict(median_ms=1e3 * median_s, **images, peak_gib=peak[name],
                          speedup=median_ratio(seconds[bench.reference], samples))
    tokens = (config["sample_size"] // config["patch_size"]) ** 2
    return dict(model=model, config=config, rows=rows, tokens=tokens, device=device_label(args.device))


# ------------------------------------------------------------------------------------------ table
def markdown(bench: StepBench, report: dict, args, command: str) -> str:
    """The setting in one line, the command, and one row per variant."""
    c = report["config"]
    precision = bench.precision_label.format(getattr(args, bench.precision_dest))
    heads = ["variant", "median ms/step", *(["images/s"] if bench.images_column else []),
             f"speed-up vs {bench.reference}", "peak GiB (warm-up)"]
    lines = [
        f"{report['model']} {bench.step}: {c['num_layers']} layers, {c['num_attention_heads']} heads x "
        f"{c['attention_head_dim']}, {report['tokens']} tokens, batch {args.batch}, {precision}, compile "
        f"{'on' if args.compile else 'off'}, device {report['device']}, torch {torch.__version__}; "
        f"{args.reps} reps after {args.warmup} warm-up.",
        f"Command: `{command}`", "",
        "| " + " | ".join(heads) + " |",
        "|---|" + "---:|" * (len(heads) - 1),
    ]
    for name, r in report["rows"].items():
        cells = [name, f"{r['median_ms']:.{bench.ms_digits}f}",
                 *([f"{r['images_s']:.1f}"] if bench.images_column else []), f"{r['speedup']:.2f}x",
                 "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
