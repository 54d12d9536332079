"""The Triton kernels' tile table (``mhla_gen.ops.tile_table``), ``triton_mhla.tile_config`` reading it, and
the tuning script's checks (``benchmarks/tune_mhla_tiles.py``). Its sweep itself runs in Triton's
interpreter in ``tests/test_triton_mhla.py::test_tuner_writes_a_table_tile_config_reads``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from script_helpers import load_script

from mhla_gen.errors import ConfigError
from mhla_gen.ops import tile_table

ROOT = Path(__file__).resolve().parents[1]


def load_tuner():
    path = ROOT / "benchmarks" / "tune_mhla_tiles.py"
    return load_script(path, "tune_mhla_tiles_under_test")


def table_with(config: dict, device: str = "cpu", key: str = "d16-e16-fp32-L16") -> dict:
    return tile_table.with_entry(tile_table.empty_table(), device, key, config, {"ms": 1.0})


def test_shape_class_rounds_to_powers_of_two():
    assert tile_table.shape_class(128, 128, torch.bfloat16, 218) == "d128-e128-bf16-L256"  # Wan 480p
    assert tile_table.shape_class(32, 32, torch.bfloat16, 1024) == "d32-e32-bf16-L1024"  # SANA 4096 px
    assert tile_table.shape_class(72, 72, torch.float16, 1) == "d128-e128-fp16-L16"
    with pytest.raises(ValueError, match="float64"):
        tile_table.shape_class(8, 8, torch.float64, 4)


def test_shipped_table_is_valid_and_ours():
    from mhla_gen.outputs.folders import file_is_ours

    table = tile_table.read_table(tile_table.TABLE_PATH)
    assert file_is_ours(tile_table.TABLE_PATH, tile_table.TABLE_KIND)
    assert all(isinstance(classes, dict) for classes in table["devices"].values())


@pytest.mark.parametrize("bad, match", [
    ({"block_t": 24}, "block_t=24"),
    ({"block_t": 32.0}, "block_t=32.0"),
    ({"split": 2}, "'split' is not a tunable field"),
    ({"fp32_state_dots": True}, "not a tunable field"),
])
def test_bad_configs_are_named(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        table_with(bad)
    path = tmp_path / "t.json"
    table = table_with({"block_t": 32})
    table["devices"]["cpu"]["d16-e16-fp32-L16"]["config"] = bad
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=match):
        tile_table.read_table(path)


def test_foreign_and_broken_tables_are_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"devices": {}}))
    with pytest.raises(ValueError, match="not an MHLA tile table"):
        tile_table.read_table(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        tile_table.read_table(path)
    assert tile_table.read_table(tmp_path / "absent.json") == tile_table.empty_table()


def test_lookup_reads_a_changed_file_again(tmp_path):
    path = tmp_path / "t.json"
    assert tile_table.lookup("cpu", "d16-e16-fp32-L16", path) == {}  # no file
    path.write_text(tile_table.dumps(table_with({"block_t": 32})))
    assert tile_table.lookup("cpu", "d16-e16-fp32-L16", path) == {"block_t": 32}
    assert tile_table.lookup("cpu", "d32-e32-fp32-L16", path) == {}
    assert tile_table.lookup("NVIDIA H200", "d16-e16-fp32-L16", path) == {}
    path.write_text(tile_table.dumps(table_with({"block_t": 128, "num_stages": 2})))
    os.utime(path, ns=(1, 10**18))  # a new modification time, whatever the file system's resolution
    assert tile_table.lookup("cpu", "d16-e16-fp32-L16", path) == {"block_t": 128, "num_stages": 2}


def test_tile_config_takes_the_table_then_the_override(monkeypatch, tmp_path):
    """Per field: the override, else the table entry of this device and shape class, else the heuristic;
    without ``dtype`` the table is not consulted."""
    pytest.importorskip("triton")
    from mhla_gen.ops import triton_mhla

    path = tmp_path / "t.json"
    path.write_text(tile_table.dumps(table_with({"block_t": 128, "num_warps": 2, "num_stages": 3},
                                                key="d16-e16-fp16-L64")))
    monkeypatch.setattr(tile_table, "TABLE_PATH", path)
    cpu = torch.device("cpu")
    shape = (16, 16, 4, 2, 40, cpu)  # d, e, blocks, batch·heads, longest block (-> L64)
    heuristic = triton_mhla.tile_config(*shape)
    assert (heuristic.block_t, heuristic.num_warps, heuristic.num_stages) == (64, 4, None)
    tuned = triton_mhla.tile_config(*shape, dtype=torch.float16)
    assert (tuned.block_t, tuned.num_warps, tuned.num_stages, tuned.block_d) == (128, 2, 3, 16)
    assert triton_mhla.tile_config(*shape, dtype=torch.float32) == heuristic  # another class
    override = triton_mhla.TileConfig(block_t=8, fp32_state_dots=True)
    mixed = triton_mhla.tile_config(*shape, override, dtype=torch.float16)
    assert (mixed.block_t, mixed.num_warps, mixed.fp32_state_dots) == (8, 2, True)


def test_tuner_lists_candidates_without_running_anything(capsys):
    tuner = load_tuner()
    tuner.main(["--list", "--shapes", "wan480", "sana4096", "--max-candidates", "3"])
    out = capsys.readouterr().out
    assert "wan480: table key d128-e128-bf16-L256" in out and "sana4096: table key d32-e32-bf16-L1024" in out
    listed = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert len(listed) == 6
    assert listed[0] == "{'block_t': 32, 'block_d': 128, 'block_e': 128, 'num_warps': 8}"  # the heuristic
    assert listed[1].startswith("{'block_t': 64,")  # then longer token tiles


def test_tuner_lists_dense_and_mixing_candidates(capsys):
    """The dense shape (DiT-XL/2 256 px) is tuned under its dense class with the fields the dense path
    reads; Wan's candidates include the mixing kernel's tiles of before 2026-11-28 and the other mixing
    tiles, none the same launch as the default or as each other."""
    tuner = load_tuner()
    tuner.main(["--list", "--shapes", "wan480", "dit256"])
    out = capsys.readouterr().out
    assert "dit256: table key dense-d128-e128-bf16-N256" in out
    dense = out.split("dit256:")[1].splitlines()[1:]
    assert dense[0].strip() == "{'block_t': 32, 'num_warps': 8}" and all("mix_" not in line for line in dense)
    wan = [line for line in out.split("dit256:")[0].splitlines() if "mix_" in line]
    assert any("'mix_block_c': 128, 'mix_num_warps': 4}" in line for line in wan)  # the tiles of before
    assert len(wan) >= 4 and len(set(wan)) == len(wan)


def test_mix_tiles_heuristic_and_overrides():
    """``triton_mixing.mix_tiles``: 64 x 64 tiles at 8 warps for Wan's 150 blocks, 16 x 256 at 4 warps for
    SANA's 16; each argument overrides its field; a row tile is at most M's next power of two."""
    pytest.importorskip("triton")
    from mhla_gen.ops import triton_mixing

    assert triton_mixing.mix_tiles(150) == triton_mixing.MixTiles(64, 32, 64, 8, None)
    assert triton_mixing.mix_tiles(16) == triton_mixing.MixTiles(16, 16, 256, 4, None)
    assert triton_mixing.mix_tiles(150, 128, 32, 4, 2) == triton_mixing.MixTiles(32, 32, 128, 4, 2)
    assert triton_mixing.mix_tiles(16, block_m=256).block_m == 16


def test_tile_config_carries_the_mixing_fields(monkeypatch, tmp_path):
    """A table entry's ``mix_*`` fields reach ``TileConfig`` (and so ``triton_mixing.mix_tiles``)."""
    pytest.importorskip("triton")
    from mhla_gen.ops import triton_mhla

    path = tmp_path / "t.json"
    path.write_text(tile_table.dumps(table_with({"mix_block_m": 32, "mix_num_warps": 4, "mix_num_stages": 2},
                                                key="d16-e16-bf16-L64")))
    monkeypatch.setattr(tile_table, "TABLE_PATH", path)
    cfg = triton_mhla.tile_config(16, 16, 150, 2, 40, torch.device("cpu"), dtype=torch.bfloat16)
    assert (cfg.mix_block_m, cfg.mix_num_warps, cfg.mix_num_stages, cfg.mix_block_c) == (32, 4, 2, None)


def test_tuner_refuses_before_any_work(tmp_path, monkeypatch):
    """A file it did not write, a table of ours that does not read back, bad numbers, a device that cannot
    run: one ConfigError naming the setting, nothing written."""
    tuner = load_tuner()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    swept = []
    monkeypatch.setattr(tuner, "sweep", lambda *args: swept.append(args))
    cpu = ["--device", "cpu", "--shapes", "tiny"]
    foreign = tmp_path / "user.json"
    foreign.write_text('{"mine": 1}')
    with pytest.raises(ConfigError, match="--out=.*not written by mhla_gen"):
        tuner.main([*cpu, "--out", str(foreign)])
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"mhla_gen": {"kind": tile_table.TABLE_KIND}, "devices": []}))
    with pytest.raises(ConfigError, match="--out=.*'devices' must be"):
        tuner.main([*cpu, "--out", str(broken)])
    for flag, value in (("--repeats", "0"), ("--max-candidates", "0"), ("--budget-s", "-1")):
        with pytest.raises(ConfigError, match=flag):
            tuner.main([*cpu, flag, value, "--out", str(tmp_path / "t.json")])
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        tuner.main([*cpu, "--out", str(tmp_path / "t.json")])
    assert foreign.read_text() == '{"mine": 1}' and not swept and not (tmp_path / "t.json").exists()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tuner.main([*cpu, "--out", str(foreign), "--overwrite"])  # the user said so: the sweep starts afresh
    assert swept and swept[0][2] == tile_table.empty_table()


@pytest.mark.gpu
def test_tuner_on_cuda(tmp_path, capsys):
    """The sweep on CUDA (CUDA-event timing, bf16) on a tiny shape: the table gets this GPU's entry."""
    tuner = load_tuner()
    out = tmp_path / "tiles.json"
    tuner.main(["--shapes", "tiny", "--max-candidates", "2", "--repeats", "2", "--out", str(out)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 2 and all(row.endswith(" ms |") for row in rows)
    (classes,) = tile_table.read_table(out)["devices"].values()
    assert list(classes) == ["d16-e16-bf16-L16"]
