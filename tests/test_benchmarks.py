"""The benchmark scripts run end to end on tiny sizes and print complete tables (numbers are not checked:
timings belong to the scripts' own runs, not to unit tests)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    return load_script(ROOT / "benchmarks" / f"{name}.py", f"scripts_{name}")


def _table_rows(text: str, first_cell: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in text.splitlines()
        if re.match(rf"\|\s*{first_cell}\s*\|", line)
    ]


def test_bench_models_prints_both_tables(capsys):
    bench = load("bench_models")
    bench.main(["--depth", "1", "--tokens", "16", "64", "--batch", "1", "--reps", "2", "--min-sample-s", "0",
                "--blocks", "2", "2"])
    out = capsys.readouterr().out
    assert "hidden 384 = 6 heads x 64" in out  # DiT-S/2's split by default
    for tokens in ("16", "64"):
        rows = _table_rows(out, tokens)
        assert len(rows) == 2  # training, inference
        for row in rows:
            throughputs = [float(cell) for cell in row[1:4]]
            ratios = [float(cell.rstrip("x")) for cell in row[4:6]]
            assert all(value > 0 for value in throughputs + ratios)


def test_bench_models_compile_table():
    """The eager-vs-compiled table: one row per size and step kind, cells from the right models."""
    bench = load("bench_models")
    items = {name + suffix: float(i + 1) for i, (name, suffix) in
             enumerate((n, s) for n in bench.MODES for s in ("", bench.COMPILED))}
    ratios = {pair: 1.25 for pair in bench.RATIOS + bench.COMPILE_RATIOS}
    results = {256: {kind: {"items_s": items, "ratio": ratios} for kind in ("train", "infer")}}
    rows = _table_rows(bench.compile_markdown(results), "256")
    assert [row[1] for row in rows] == ["train", "infer"]
    assert rows[0][2:] == ["1.00", "2.00", "3.00", "4.00", "5.00", "6.00", "1.25x", "1.25x"]


def test_attention_timer_measures_the_attention_modules():
    """The breakdown's timer counts the time inside every block's attn1 and nothing else: a processor
    that sleeps 20 ms per call shows up as at least 20 ms per layer, and a model step takes longer."""
    import time

    bench = load("bench_models")
    model = bench.build_models(2, (2, 2), "cpu", bench.torch.float32)["softmax"]
    stock = model.transformer_blocks[0].attn1.processor

    def sleeping(attn, hidden_states, *args, **kwargs):
        time.sleep(0.02)
        return stock(attn, hidden_states, *args, **kwargs)

    for block in model.transformer_blocks:
        block.attn1.set_processor(sleeping)
    timer = bench.AttentionTimer(model, "cpu")
    x, _, t, y = bench.make_batch(16, 1, "cpu", bench.torch.float32)
    start = time.perf_counter()
    model(x, timestep=t, class_labels=y)
    step_s = time.perf_counter() - start
    assert 2 * 0.02 <= timer.total_s < step_s


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
     ["--blocks", "0", "2"]],
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
        [sys.executable, str(ROOT / "benchmarks" / "bench_attention.py"), "--device", "cpu", "--repeats", "1",
         "--sizes", "64", "--blocks", "1", "4", "--heads", "2", "--dim", "8", "--threads", "1",
         "--out", str(out)],
        check=True, timeout=300,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(row["N"], row["M"]) for row in rows] == [(64, 1), (64, 4)]


def test_bench_attention_grid_table():
    """``--grids``: per-token ratios against the first case, MHLA / LA pairs and the flop ratio."""
    bench = load("bench_attention")
    args = bench.argparse.Namespace(grids=[bench.parse_grid_case(c) for c in ("4x5:2x2", "4x6:2x2")])
    times = {}
    for case, scale in (("4x5:2x2", 1.0), ("4x6:2x2", 1.5)):  # 20, 24 tokens: 1.5 * 20 / 24 = 1.25x
        for mode in ("fwd", "fwd_bwd"):
            times[case, "la", mode] = [0.010 * scale] * 3
            times[case, "mhla", mode] = [0.012 * scale] * 3
    memory = {(c, m): 10.0 if m == "la" else 11.0 for c in ("4x5:2x2", "4x6:2x2") for m in ("la", "mhla")}
    rows = _table_rows(bench.grids_markdown(args, times, memory), "4x6:2x2")
    assert rows[0][7:] == ["1.20×", "1.20×", "1.33", "10", "11", "1.10×", "1.25×", "1.25×"]


_PEAK_SNIPPET = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("bench", sys.argv[1])
bench = sys.modules["bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
peak = bench.PeakMemory(torch.device("cpu"))

def call():
    a = torch.ones(64 * 2**18)  # 64 MiB
    b = torch.ones(2**18)  # 1 MiB after it
    del a
    c = torch.ones(96 * 2**18)  # 96 MiB: on a heap it cannot reuse a's hole
    del b, c

print(peak.measure(call))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables")
def test_bench_attention_peak_memory_ignores_kept_memory_tunables():
    """Under the README's kept-memory setting (no mmap) freed buffers would stay in the heap and count
    towards the peak (161 MiB here); the peak process restores mmap, so the live peak (97 MiB) is what
    it reports."""
    env = {**os.environ,
           "GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295"}
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_SNIPPET, str(ROOT / "benchmarks" / "bench_attention.py")],
        env=env, check=True, timeout=120, capture_output=True, text=True,
    )
    assert 95 < float(result.stdout.split()[-1]) < 110


@pytest.mark.parametrize("text", ["21x30", "21x30:3x5x10", "4x4:5x1", "axb:1x1"])
def test_bench_attention_rejects_bad_grids(text):
    bench = load("bench_attention")
    with pytest.raises(bench.argparse.ArgumentTypeError, match="--grids"):
        bench.parse_grid_case(text)


def test_conversion_budget_counts_mhla_and_depthwise_convolutions(monkeypatch):
    """The budget's FLOP counts on tiny models: the registered MHLA op is counted (a model whose only
    attention is MHLA still has attention FLOPs), and a depthwise convolution's backward costs what its
    forward costs twice, not a dense convolution's."""
    from mhla_gen import MHLAConfig
    from mhla_gen.testing import TINY_SANA_CONFIG

    budget = load("conversion_budget")
    conv = torch.nn.Conv2d(8, 8, 3, groups=8, padding=1)
    x = torch.randn(1, 8, 6, 6, requires_grad=True)
    forward = budget.count(lambda: conv(x))
    assert budget.count(lambda: conv(x).sum().backward()) == 3 * forward
    from mhla_gen import BlockLayout, mhla_attention

    q, k, v = (torch.randn(2, 3, 16, 4) for _ in range(3))
    layout = BlockLayout((4, 4), (2, 2))
    flops = budget.count(lambda: mhla_attention(q, k, v, layout, torch.eye(4)))
    assert flops == 2 * 3 * (4 * 16 * 4 * 5 + 2 * 4 * 4 * 5 * 4)  # summaries + output + mixing GEMMs
    config = {**TINY_SANA_CONFIG, "sample_size": 8}
    tiny = (budget.SanaTransformer2DModel, config, MHLAConfig(blocks=(2, 2)))
    monkeypatch.setitem(budget.MODELS, "tiny", tiny)
    monkeypatch.setattr(budget, "inputs", lambda cls, cfg: (
        (torch.empty(1, cfg["in_channels"], 8, 8),),
        dict(encoder_hidden_states=torch.empty(1, 5, cfg["caption_channels"]), timestep=torch.zeros(1))))
    row = budget.budget("tiny")
    assert 2.5 < row["training step"] / row["teacher forward"] < 3.5
    assert row["teacher forward"] < row["stage 1 (mhla)"] < row["stage 1 (all)"] < row["training step"]


# --------------------------------------------------------------------------------------------------
# host vs GPU time: the host-overhead table, the CUDA-graph tables, the whole-model steps (CPU plumbing)


def test_bench_host_overhead_prints_every_layer(capsys):
    bench = load("bench_host_overhead")
    bench.main(["--device", "cpu", "--reps", "2", "--calls", "2", "--threads", "1"])
    rows = _table_rows(capsys.readouterr().out, "pytorch")
    assert [row[2] for row in rows] == [f"`{name}`" for name in bench.LAYERS]
    assert all(float(row[3]) > 0 and float(row[5]) > 0 for row in rows)  # µs per forward, forward+backward
    assert rows[0][4] == rows[0][6] == "–"  # the backend row is the baseline of the overhead columns


def test_bench_host_overhead_layers_run_what_they_name(monkeypatch):
    """Each layer's calls go where its name says: the op's dispatcher (profiler events ``mhla_gen::``) for
    ``op`` and ``mhla_attention via op`` only, and every layer computes the same output."""
    bench = load("bench_host_overhead")
    forward, forward_backward = bench.layer_calls("tiny", "pytorch", torch.device("cpu"), torch.float32)
    outputs = {}
    for name in bench.LAYERS:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = forward[name]()
            forward_backward[name]()
        ops = {e.key for e in prof.key_averages() if e.key.startswith("mhla_gen::")}
        assert bool(ops) == (name in ("op", "mhla_attention via op")), (name, ops)
        outputs[name] = out[0] if isinstance(out, tuple) else out
    for name, out in outputs.items():
        torch.testing.assert_close(out, outputs["backend"], rtol=1e-5, atol=1e-6, msg=name)


def test_bench_attention_cuda_graphs_tables_on_cpu(capsys):
    """``--cuda-graphs`` on CPU: the eager columns are measured, the graph columns are "–" (no CUDA)."""
    bench = load("bench_attention")
    bench.main(["--device", "cpu", "--cuda-graphs", "--repeats", "1", "--graph-shape", "1", "2", "8",
                "--shapes", "--graph-sizes", "16", "--crossover-sizes", "16", "64", "--threads", "1"])
    out = capsys.readouterr().out
    rows = _table_rows(out, "N=16")
    assert [row[3] for row in rows] == ["FlashAttention", "LA", "MHLA"]
    for row in rows:
        assert float(row[4]) > 0 and row[5] == "–" and float(row[7]) > 0 and row[8] == "–"
    crossover = _table_rows(out, "16") + _table_rows(out, "64")
    assert [row[1] for row in crossover] == ["fwd", "f+b", "fwd", "f+b"]
    assert "- forward: MHLA takes at most FlashAttention's time from N = " in out


def test_crossover_is_the_smallest_n_from_which_mhla_stays_faster():
    bench = load("bench_attention")

    def times(ratios):  # {N: (MHLA / FA eager, MHLA / FA graph)}
        return {n: {("sdpa", "fwd"): (1.0, 1.0), ("mhla_op", "fwd"): r} for n, r in ratios.items()}

    measured = times({64: (3.0, 0.5), 256: (0.9, 0.8), 1024: (1.1, 1.0), 4096: (0.5, 0.2), 16384: (0.2, 0.1)})
    assert bench.crossover_n(measured, "fwd", 0) == "4096"  # 256 is faster, but 1024 is not again
    assert bench.crossover_n(measured, "fwd", 1) == "64"  # a tie counts as at most FA's time
    assert bench.crossover_n(times({64: (2.0, 2.0), 256: (1.5, 1.5)}), "fwd", 0) == "none"
    nan = {64: {("sdpa", "fwd"): (1.0, float("nan")), ("mhla_op", "fwd"): (1.0, float("nan"))}}
    assert bench.crossover_n(nan, "fwd", 1) == "–"


def test_bench_dit_step_tiny(capsys):
    bench = load("bench_dit_step")
    report = bench.main(["--tiny", "--device", "cpu", "--batch", "2", "--reps", "2", "--warmup", "1",
                         "--threads", "1"])
    out = capsys.readouterr().out
    assert "tiny DiT (TINY_DIT_CONFIG) training step" in out
    assert "Command: `python benchmarks/bench_dit_step.py --tiny" in out
    rows = _table_rows(out, "(softmax|mhla)")
    assert [row[0] for row in rows] == ["softmax", "mhla"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows) and rows[0][3] == "1.00x"
    assert report["tokens"] == 16


def test_bench_dit_step_trains_both_models(monkeypatch):
    """The step trains: every parameter of both models moves, and MHLA's mixing stays in [0, 1]."""
    bench = load("bench_dit_step")
    from mhla_gen import mhla_parameters
    from mhla_gen.testing import TINY_DIT_CONFIG

    args = bench.parse_args(["--tiny", "--device", "cpu", "--batch", "2"])
    models = bench.build_models(dict(TINY_DIT_CONFIG), args.device)
    scheduler = bench.DDPMScheduler(num_train_timesteps=1000)
    objective = bench.DDPMLoss(scheduler, learn_sigma=True)
    batch = bench.make_batch(dict(TINY_DIT_CONFIG), 2, scheduler, args.device)
    for name, model in models.items():
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        bench.training_step(model, model, optimizer, objective, batch, args)
        moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
        assert len(moved) > 0.9 * len(before), name
        assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none)
    mixing = [p for n, p in mhla_parameters(models["mhla"]).items() if "mixing" in n]
    assert mixing and all(0 <= p.min() and p.max() <= 1 for p in mixing)


def test_bench_sana_step_tiny(capsys):
    bench = load("bench_sana_step")
    report = bench.main(["--tiny", "--device", "cpu", "--batch", "1", "--reps", "2", "--warmup", "1",
                         "--threads", "1"])
    out = capsys.readouterr().out
    rows = _table_rows(out, "(stock|mhla)")
    assert [row[0] for row in rows] == ["stock", "mhla"] and rows[0][2] == "1.00x"
    assert all(float(row[1]) > 0 for row in rows)
    assert report["tokens"] == 256


def test_step_tables_show_each_benchmarks_columns_and_the_cuda_peak(monkeypatch):
    """The shared table (step_timing.markdown): DiT's images/s column and ms to 0.1, SANA's ms to 0.01, the
    warm-up peak where CUDA measured one; and the precision each script defaults to on CUDA."""
    timing, dit, sana = load("step_timing"), load("bench_dit_step"), load("bench_sana_step")
    config = dict(num_layers=28, num_attention_heads=16, attention_head_dim=72)
    rows = {"a": dict(median_ms=12.345, images_s=2592.2, peak_gib=3.456, speedup=1.0),
            "b": dict(median_ms=6.0, images_s=5333.3, peak_gib=None, speedup=2.04)}
    report = dict(model="M", config=config, rows=rows, tokens=256, device="D")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # parsing only: --device cuda accepted
    out = timing.markdown(dit.BENCH, report, dit.parse_args(["--device", "cuda"]), "python x")
    assert ("M training step (random weights): 28 layers, 16 heads x 72, 256 tokens, batch 32, mixed "
            "precision bf16, compile off, device D") in out
    assert _table_rows(out, "a") == [["a", "12.3", "2592.2", "1.00x", "3.46"]]
    assert _table_rows(out, "b") == [["b", "6.0", "5333.3", "2.04x", "-"]]
    args = sana.parse_args(["--device", "cuda", "--batch", "1"])
    out = timing.markdown(sana.BENCH, report, args, "python x")
    assert "| variant | median ms/step | speed-up vs stock | peak GiB (warm-up) |" in out
    assert "(random weights, inference): 28 layers, 16 heads x 72, 256 tokens, batch 1, bf16, compile" in out
    assert _table_rows(out, "a") == [["a", "12.35", "1.00x", "3.46"]]


def test_full_size_dit_and_sana_configs_on_meta():
    """DiT-XL/2 (diffusers' layout: 750 M parameters, 28 layers of 16 x 72) and SANA-1.6B (1.60 B; 20
    layers of 70 x 32) as the step benchmarks build them, MHLA installed in every self-attention."""
    from diffusers import DiTTransformer2DModel, SanaTransformer2DModel

    from mhla_gen.integration.install import mhla_processors

    dit, sana = load("bench_dit_step"), load("bench_sana_step")
    with torch.device("meta"):
        models = {"dit": DiTTransformer2DModel(**dit.DIT_XL2_CONFIG),
                  "sana": SanaTransformer2DModel(**sana.SANA_1600M_1024_CONFIG)}
    millions = {name: sum(p.numel() for p in m.parameters()) / 1e6 for name, m in models.items()}
    assert 745 < millions["dit"] < 755 and 1600 < millions["sana"] < 1610, millions
    from mhla_gen import MHLAConfig, install_mhla

    install_mhla(models["dit"], MHLAConfig.preset("dit-256"))
    install_mhla(models["sana"], MHLAConfig.preset("sana"))
    assert len(mhla_processors(models["dit"])) == 28 and len(mhla_processors(models["sana"])) == 20


def test_kernel_resources_compiles_for_a_gpu_without_one(capsys):
    """``benchmarks/kernel_resources.py`` compiles the mixing kernel for sm_90 on a machine without a GPU and
    prints its row complete (warps, registers, spilled bytes, shared KB); a bad --arch is refused."""
    pytest.importorskip("triton")
    from mhla_gen.errors import ConfigError

    module = load("kernel_resources")
    module.main(["--shapes", "sana4096"])
    rows = _table_rows(capsys.readouterr().out, "sana4096")
    assert len(rows) == 1 and rows[0][1].startswith("mixing") and all(c.isdigit() for c in rows[0][2:6])
    with pytest.raises(ConfigError, match="--arch=70"):
        module.main(["--arch", "70"])
