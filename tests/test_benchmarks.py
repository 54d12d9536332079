"""The benchmark scripts run end to end on tiny sizes and print complete tables (numbers are not checked:
timings belong to the scripts' own runs, not to unit tests)."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _table_rows(text: str, first_cell: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in text.splitlines()
        if re.match(rf"\|\s*{first_cell}\s*\|", line)
    ]


def test_bench_models_prints_both_tables(capsys):
    bench = load("bench_models")
    bench.main(["--depth", "1", "--tokens", "16", "64", "--batch", "1", "--reps", "2", "--min-sample-s", "0",
                "--blocks", "2", "2", "--malloc", "stock"])  # stock: leave this process's allocator alone
    out = capsys.readouterr().out
    assert "hidden 384 = 6 heads x 64" in out  # DiT-S/2's split by default
    assert "malloc stock" in out
    for tokens in ("16", "64"):
        rows = _table_rows(out, tokens)
        assert len(rows) == 3  # training, inference, page faults
        for row in rows[:2]:
            throughputs = [float(cell) for cell in row[1:4]]
            ratios = [float(cell.rstrip("x")) for cell in row[4:6]]
            assert all(value > 0 for value in throughputs + ratios)
        assert len(rows[2]) == 7 and all(float(cell) >= 0 for cell in rows[2][1:])


def test_bench_models_retain_malloc_in_a_subprocess():
    """The default allocator setting (glibc keeps freed memory) in a process of its own: a steady state
    with (almost) no page faults per step once the warm-up has grown the heap. With ``--malloc stock`` this
    config faults about 4000 pages per training step (the gradients that ``zero_grad`` frees)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_models.py"), "--depth", "1", "--tokens", "64",
         "--batch", "1", "--reps", "3", "--min-sample-s", "0", "--blocks", "2", "2", "--threads", "1"],
        check=True, timeout=300, capture_output=True, text=True,
    )
    assert "malloc retain" in result.stdout
    faults = [float(cell) for cell in _table_rows(result.stdout, "64")[2][1:]]
    assert max(faults) <= 8, faults  # training and inference: a few pages at most


def test_bench_models_attention_breakdown(capsys):
    """The split table: attention and rest are positive and add up to about the measured step time."""
    bench = load("bench_models")
    bench.main(["--depth", "1", "--tokens", "16", "--batch", "1", "--reps", "2", "--min-sample-s", "0",
                "--blocks", "2", "2", "--attention-breakdown", "--malloc", "stock"])
    out = capsys.readouterr().out
    _, infer_row, _, breakdown_row = _table_rows(out, "16")
    step_ms = [1e3 / float(cell) for cell in infer_row[1:4]]  # batch 1: ms per step = 1000 / items/s
    attn_ms = [float(cell) for cell in breakdown_row[1:4]]
    rest_ms = [float(cell) for cell in breakdown_row[5:8]]
    # each printed cell is rounded to 0.01 (±0.005): the printed difference may be off by up to 0.015
    assert float(breakdown_row[4]) == pytest.approx(attn_ms[2] - attn_ms[1], abs=0.016)
    for step, attn, rest in zip(step_ms, attn_ms, rest_ms):
        assert attn > 0 and rest > 0
        assert attn + rest == pytest.approx(step, rel=0.5)  # medians of different samples: loose


def test_bench_models_hooks_are_removed():
    bench = load("bench_models")
    model = bench.build_models(1, (2, 2), "cpu", bench.torch.float32)["mhla"]
    timer = bench.AttentionTimer(model, "cpu")
    x, _, t, y = bench.make_batch(16, 1, "cpu", bench.torch.float32)
    model(x, timestep=t, class_labels=y)
    assert timer.total_s > 0
    timer.remove()
    timer.total_s = 0.0
    model(x, timestep=t, class_labels=y)
    assert timer.total_s == 0.0


@pytest.mark.parametrize(
    "argv",
    [["--tokens", "200"], ["--min-sample-s", "-1"], ["--reps", "0"], ["--heads", "0"], ["--head-dim", "0"],
     ["--malloc", "jemalloc"]],
)
def test_bench_models_rejects_bad_arguments(argv, capsys):
    bench = load("bench_models")
    with pytest.raises(SystemExit) as err:
        bench.parse_args(argv)
    assert err.value.code == 2
    assert argv[0] in capsys.readouterr().err  # the message names the option


def test_bench_attention_writes_rows(tmp_path):
    """A subprocess: on CPU the script measures memory in a spawned child, which must import it by path."""
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_attention.py"), "--device", "cpu", "--repeats", "1",
         "--sizes", "64", "--blocks", "1", "4", "--heads", "2", "--dim", "8", "--threads", "1",
         "--out", str(out)],
        check=True, timeout=300,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(row["N"], row["M"]) for row in rows] == [(64, 1), (64, 4)]
    for row in rows:
        assert row["peak_mib_mhla"] >= 0 and row["peak_mib_la"] >= 0
