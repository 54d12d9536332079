"""benchmarks/bench_wan_step.py (issue 13's Wan2.1-1.3B denoising-step benchmark) end to end on a tiny Wan,
plus its full-size config and presets checked on the meta device (no weights, no compute). Timings are not
checked: they belong to the script's own GPU run."""

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from script_helpers import load_script

from mhla_gen import MHLAConfig, install_mhla
from mhla_gen.integration.install import is_mhla_installed, mhla_processors
from mhla_gen.testing.wan import TINY_WAN_CONFIG

ROOT = Path(__file__).resolve().parents[1]
TINY_ARGS = ["--tiny", "--frames", "5", "--height", "32", "--width", "48", "--batch", "1", "--reps", "2",
             "--warmup", "1", "--device", "cpu", "--dtype", "fp32", "--threads", "1"]


@pytest.fixture(scope="module")
def bench():
    return load_script(ROOT / "benchmarks" / "bench_wan_step.py", "scripts_bench_wan_step")


def _table_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\|\s*(stock|mhla-hybrid|mhla)\s*\|", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in line.strip().strip("|").split("|")]
    return rows


def test_tiny_run_prints_the_three_variants(bench, capsys, tmp_path):
    out_file = tmp_path / "wan_step.json"
    report = bench.main([*TINY_ARGS, "--out", str(out_file)])
    out = capsys.readouterr().out
    assert "token grid (2, 2, 3)" in out and "dtype fp32" in out and f"torch {torch.__version__}" in out
    assert "Command: `python benchmarks/bench_wan_step.py --tiny --frames 5" in out
    rows = _table_rows(out)
    assert list(rows) == ["stock", "mhla-hybrid", "mhla"]
    # MHLA / softmax layers (the tiny model has 3; the hybrid keeps layer 0 softmax, as i % 3 == 0)
    assert [rows[name][1] for name in rows] == ["0 / 3", "2 / 1", "3 / 0"]
    assert [rows[name][2] for name in rows] == ["-", "2x2x3", "2x2x3"]  # (3, 5, 10) capped at the grid
    for row in rows.values():
        median_ms, min_ms, speedup = float(row[3]), float(row[4]), float(row[5].rstrip("x"))
        assert 0 < min_ms <= median_ms and speedup > 0
    assert rows["stock"][5] == "1.00x"
    saved = json.loads(out_file.read_text())
    assert saved["token_grid"] == [2, 2, 3] and saved["latent"] == [1, 16, 2, 4, 6]
    for name in bench.VARIANTS:
        assert len(saved["variants"][name]["ms_per_step"]) == 2
        assert saved["variants"][name]["mhla_installed"] == (name != "stock")
    assert report["variants"]["mhla"]["speedup"] == saved["variants"]["mhla"]["speedup"]


def test_build_variants_installs_the_presets(bench):
    grid = (2, 2, 3)
    models = bench.build_variants(TINY_WAN_CONFIG, grid, "cpu", torch.float32)
    assert not is_mhla_installed(models["stock"]) and not mhla_processors(models["stock"])
    assert type(models["stock"].blocks[0].attn1.processor).__name__ == "WanAttnProcessor"
    hybrid, full = models["mhla-hybrid"], models["mhla"]
    assert is_mhla_installed(hybrid) and is_mhla_installed(full)
    assert hybrid.mhla_config.layers == [1, 2] and full.mhla_config.layers is None
    assert hybrid.mhla_config.blocks == full.mhla_config.blocks == (2, 2, 3)
    assert bench.layer_counts(hybrid) == (2, 3) and bench.layer_counts(full) == (3, 3)
    assert type(hybrid.blocks[0].attn1.processor).__name__ == "WanAttnProcessor"
    # the copies share no storage: one random model, three independent copies of its weights
    w = [m.blocks[0].attn1.to_q.weight for m in models.values()]
    assert torch.equal(w[0], w[1]) and w[0].data_ptr() != w[1].data_ptr()


def test_bf16_keeps_diffusers_fp32_modules(bench):
    torch.manual_seed(0)
    model = bench.cast_like_diffusers(bench.WanTransformer3DModel(**TINY_WAN_CONFIG), torch.bfloat16)
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert model.proj_out.weight.dtype == torch.bfloat16
    assert model.scale_shift_table.dtype == model.blocks[0].scale_shift_table.dtype == torch.float32
    assert model.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32


def test_full_size_config_and_presets_on_meta(bench):
    """The 1.3B architecture (1.42 B parameters, as diffusers' Wan2.1-T2V-1.3B) and its 480p inputs:
    latent (2, 16, 21, 60, 104), token grid (21, 30, 52), presets unchanged by the fitting."""
    shape = bench.latent_shape(81, 480, 832, 2)
    grid = bench.token_grid(bench.WAN_1_3B_CONFIG, shape)
    assert shape == (2, 16, 21, 60, 104) and grid == (21, 30, 52)
    configs = bench.variant_configs(grid, 30)
    assert configs["mhla"] == MHLAConfig.preset("wan2.1-1.3b-480p")
    assert configs["mhla-hybrid"] == MHLAConfig.preset("wan2.1-1.3b-480p-hybrid")
    with torch.device("meta"):
        model = bench.WanTransformer3DModel(**bench.WAN_1_3B_CONFIG)
    assert 1.40e9 < sum(p.numel() for p in model.parameters()) < 1.44e9
    assert model.blocks[0].attn1.heads == 12 and len(model.blocks) == 30
    install_mhla(model, configs["mhla-hybrid"])
    assert bench.layer_counts(model) == (20, 30)
    assert bench.layer_counts(install_mhla(copy.deepcopy(model), configs["mhla"])) == (30, 30)


@pytest.mark.parametrize(
    "args, option",
    [
        (["--frames", "80"], "--frames"),
        (["--height", "500"], "--height"),
        (["--width", "0"], "--width"),
        (["--batch", "0"], "--batch"),
        (["--reps", "0"], "--reps"),
    ],
)
def test_bad_arguments_name_the_option(bench, capsys, args, option):
    with pytest.raises(SystemExit) as error:
        bench.main([*args, "--device", "cpu"])  # rejected at start-up, before any model is built
    assert error.value.code == 2
    assert option in capsys.readouterr().err
