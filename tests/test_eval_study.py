"""eval/study.py --quick: three tiny DiTs (softmax, linear, MHLA) trained, sampled, scored, tabulated."""

import importlib.util
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_study_quick(tmp_path):
    spec = importlib.util.spec_from_file_location("eval_study", ROOT / "eval" / "study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    results = module.main(["--quick", "--out", str(tmp_path)])
    assert [r["attention"] for r in results] == ["softmax", "linear", "mhla"]
    kinds = {r["attention"]: {s["kind"] for s in r["attention_stats"]["per_layer"]} for r in results}
    assert kinds == {"softmax": {"softmax"}, "linear": {"mhla"}, "mhla": {"mhla"}}  # linear = 1-block MHLA
    # identical size: MHLA adds only its M×M mixing matrix per layer (M = 1 for linear, 2×2 = 4 blocks here)
    sizes = [r["parameters"] for r in results]
    assert sizes[1] - sizes[0] == 1 and sizes[2] - sizes[0] == 16
    table = (tmp_path / "study.md").read_text()
    assert table.count("\n| ") == 4 and "FID" in table  # header + 3 rows
    assert (tmp_path / "study_samples.png").stat().st_size > 0
    saved = json.loads((tmp_path / "study.json").read_text())
    assert [r["fid_digits"] for r in saved["results"]] == [r["fid_digits"] for r in results]
    for r in results:  # 3 training steps: far from the digits (real-vs-real digits FID is about 9)
        assert math.isfinite(r["fid_digits"]) and r["fid_digits"] > 20, r["fid_digits"]
        assert f"| {r['attention']} | {r['fid_digits']:.2f} |" in table  # the table shows what was measured
