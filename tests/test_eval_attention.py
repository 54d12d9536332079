"""Per-layer attention statistics: capture matches what the processors compute, kinds, ranges."""

import math

import pytest
import torch
from script_helpers import load_script

from mhla_gen.bases import BASES
from mhla_gen.integration.install import install_mhla, mhla_processors
from mhla_gen.metrics.attention import (
    attention_statistics,
    capture_qk,
    example_inputs,
    save_attention_statistics,
)
from mhla_gen.metrics.attention_maps import attention_matrix, mirror_block_share, mirror_mass
from mhla_gen.processors.config import MHLAConfig
from mhla_gen.testing import tiny_dit, tiny_sana


def run_forward(model):
    kwargs = example_inputs(model, batch=2, size=8)  # DiT (patch 2): 16 tokens; SANA (patch 1): 64
    return lambda: model(**kwargs)


@pytest.mark.parametrize("factory", [tiny_dit, tiny_sana])
def test_captured_qk_are_what_the_mhla_kernel_sees(factory, monkeypatch):
    model = install_mhla(factory().eval(), MHLAConfig(blocks=(2, 2)))
    seen = []
    for attn in (block.attn1 for block in model.transformer_blocks):
        original = attn.processor.attend
        monkeypatch.setattr(attn.processor, "attend", lambda q, k, v, grid, original=original:
                            seen.append((q, k, grid)) or original(q, k, v, grid))
    with capture_qk(model) as records, torch.no_grad():
        run_forward(model)()
    assert len(records) == len(seen) == 2
    for (q, k, grid), slot in zip(seen, records.values()):
        assert slot["kind"] == "mhla" and slot["grid"] == grid
        torch.testing.assert_close(slot["q"], q)
        torch.testing.assert_close(slot["k"], k)


@pytest.mark.parametrize("name", sorted(BASES))
def test_statistics_of_every_base(name):
    """Every base record: ``example_inputs`` asks the record's test reference for the conditioning (it no
    longer guesses it from the conditioning kind), and the statistics cover every self-attention layer,
    its MHLA layers (the test config: some layers only where the model has several) as ``mhla``."""
    tiny = BASES[name].tiny.load()
    model = install_mhla(tiny.model().eval(), tiny.mhla)
    stats = attention_statistics(model, run_forward(model))
    layers = BASES[name].processor.self_attention(model)
    assert len(stats) == len(layers)
    assert sum(s["kind"] == "mhla" for s in stats) == len(mhla_processors(model)) > 0
    for s in stats:
        assert 1 <= s["rank"] <= s["tokens"] and 0 <= s["entropy"] <= s["max_entropy"] + 1e-9


def test_kinds_and_ranges():
    softmax_model = tiny_dit().eval()
    sana_model = tiny_sana().eval()
    for model, kind, tokens in ((softmax_model, "softmax", 16), (sana_model, "linear", 64)):
        stats = attention_statistics(model, run_forward(model))
        assert [s["kind"] for s in stats] == [kind, kind]
        for s in stats:
            assert 1 <= s["rank"] <= s["tokens"] == tokens
            assert 0 <= s["entropy"] <= s["max_entropy"] + 1e-9
            assert s["max_entropy"] == pytest.approx(math.log(tokens))


def stats_beside_captures(model):
    """``(layer statistics, captured slot)`` pairs of two identical forwards of ``model``."""
    stats = attention_statistics(model, run_forward(model))
    with capture_qk(model) as records, torch.no_grad():
        run_forward(model)()
    return list(zip(stats, records.values()))


def test_one_block_mhla_equals_linear_attention_stats():
    model = install_mhla(tiny_dit().eval(), MHLAConfig(blocks=(1, 1)))
    for s, slot in stats_beside_captures(model):
        linear = attention_matrix(slot["q"], slot["k"], "linear")
        assert s["entropy"] == pytest.approx(
            -(linear * linear.clamp_min(1e-300).log()).sum(-1).mean().item(), rel=1e-9)


def test_mirror_mass_is_that_of_the_layers_maps():
    model = install_mhla(tiny_dit().eval(), MHLAConfig(blocks=(2, 2)))
    for s, slot in stats_beside_captures(model):
        proc = slot["attn"].processor
        maps = attention_matrix(slot["q"], slot["k"], "mhla", proc.layout(slot["grid"], 16), proc.mixing())
        per_head = mirror_mass(maps, slot["grid"]).mean(0)
        assert s["mirror_mass"] == pytest.approx(per_head.mean().item(), rel=1e-9)
        assert s["mirror_mass_best_head"] == pytest.approx(per_head.max().item(), rel=1e-9)
        assert s["mirror_block_share"] == mirror_block_share(proc.mixing(), (2, 2))


def test_too_many_tokens_and_outputs(tmp_path):
    model = tiny_dit().eval()
    with pytest.raises(ValueError, match="max_tokens"):
        attention_statistics(model, run_forward(model), max_tokens=8)
    stats = attention_statistics(model, run_forward(model))
    save_attention_statistics(stats, tmp_path / "a.json", tmp_path / "a.png", title="tiny")
    assert (tmp_path / "a.json").stat().st_size > 0 and (tmp_path / "a.png").stat().st_size > 0


def test_attention_stats_cli_on_a_saved_mhla_dit(tmp_path):
    import json

    from mhla_gen.outputs.folders import write_marker

    run = tmp_path / "run"  # a training run of ours: the default --out-dir lies in it
    run.mkdir()
    write_marker(run, "run")
    model = install_mhla(tiny_dit(in_channels=1, out_channels=2), MHLAConfig(blocks=(2, 2)))
    model.save_pretrained(run / "final")
    module = load_script("eval/attention_stats.py", "eval_attention_stats")
    stats = module.main(["--model", str(run / "final"), "--digits", "--size", "8", "--batch", "2"])
    assert [s["kind"] for s in stats] == ["mhla", "mhla"]
    written = json.loads((run / "attention_stats" / "attention_stats.json").read_text())
    assert written == stats and (run / "attention_stats" / "attention_stats.png").exists()
    with pytest.raises(ValueError, match="--shapes needs a 3-channel"):
        module.main(["--model", str(run / "final"), "--shapes", "--out-dir", str(tmp_path / "s")])
    rgb = install_mhla(tiny_dit(in_channels=3, out_channels=6, sample_size=32), MHLAConfig(blocks=(4, 4)))
    rgb.save_pretrained(tmp_path / "pipeline" / "transformer")  # e.g. a pipeline folder of the user's
    with pytest.raises(ValueError, match=r"--out-dir not given, .* which holds --model and is not a training "
                                         r"run of mhla_gen; nothing was written: pass --out-dir .*"
                                         r"mhla-gen adopt run .*pipeline"):
        module.main(["--model", str(tmp_path / "pipeline" / "transformer"), "--shapes", "--batch", "2"])
    assert sorted(p.name for p in (tmp_path / "pipeline").iterdir()) == ["transformer"]
    weights = run / "final" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])  # a copy cut short: one line, nothing written
    with pytest.raises(ValueError, match=r"--model .*final: .* is not a readable safetensors file"):
        module.main(["--model", str(run / "final"), "--digits", "--out-dir", str(tmp_path / "cut")])
    assert not (tmp_path / "cut").exists()
    stats = module.main(["--model", str(tmp_path / "pipeline" / "transformer"), "--shapes", "--batch", "2",
                         "--out-dir", str(tmp_path / "rgb_stats")])
    assert all(0 <= s["mirror_mass"] <= s["mirror_mass_best_head"] <= 1 for s in stats)
