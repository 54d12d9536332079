"""Interleaved timing of whole model steps, for ``bench_dit_step.py`` and ``bench_sana_step.py``.

Every repetition runs each variant's step once, starting at a rotating variant, so drift of the machine
(clocks, temperature, other processes) hits all variants alike; on CUDA the device is synchronised before
and after each timed step. Results are medians of the samples and medians of per-repetition ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


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
