"""eval/fid.py end to end on tiny PNG folders and .npz files with the offline digits extractor."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from script_helpers import load_script

from mhla_gen.data.digits import digits_tensors

ROOT = Path(__file__).resolve().parents[1]


def load_eval_fid():
    return load_script(ROOT / "eval" / "fid.py", "eval_fid")


@pytest.fixture(scope="module")
def eval_fid():
    return load_eval_fid()  # uses the default digits-extractor cache (trained once per machine)


def write_pngs(folder: Path, images: np.ndarray) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(images):
        Image.fromarray(img).save(folder / f"{i:05d}.png")
    return folder


def digits_uint8(start, stop, size=32):
    import torch.nn.functional as F

    imgs = F.interpolate(digits_tensors(16)[0][start:stop], size=size, mode="bilinear")
    return (imgs.squeeze(1).numpy() * 255).round().astype(np.uint8)


def test_fid_cli_folders_npz_and_ref_stats(eval_fid, tmp_path):
    real = write_pngs(tmp_path / "real", digits_uint8(0, 200))
    good = write_pngs(tmp_path / "good", digits_uint8(200, 400))
    noise = np.random.default_rng(0).integers(0, 256, size=(200, 32, 32, 3), dtype=np.uint8)
    np.savez(tmp_path / "noise.npz", arr_0=noise)

    m_good = eval_fid.main(["--samples", str(good), "--ref", str(real), "--kid-subsets", "10",
                            "--save-ref-stats", str(tmp_path / "ref.npz")])
    written = json.loads((tmp_path / "good.fid.json").read_text())  # beside the samples, named after them
    assert written["fid"] == pytest.approx(m_good["fid"])
    for key in ("fid", "sfid", "kid", "inception_score", "precision", "recall"):
        assert np.isfinite(m_good[key]), key
    assert m_good["num_samples"] == 200 and m_good["extractor"].startswith("digits-cnn")

    m_noise = eval_fid.main(["--samples", str(tmp_path / "noise.npz"), "--ref", str(tmp_path / "ref.npz"),
                             "--kid-subsets", "10", "--out", str(tmp_path / "noise.json")])
    assert m_noise["fid"] > 10 * m_good["fid"] and m_noise["kid"] > m_good["kid"]
    assert m_noise["precision"] < m_good["precision"]
    assert m_good["inception_score"] > m_noise["inception_score"]
    assert (tmp_path / "noise.json").exists()


def test_fid_cli_errors_name_the_input(eval_fid, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        eval_fid.main(["--samples", str(tmp_path / "empty"), "--ref", "digits"])
    with pytest.raises(SystemExit):  # argparse: "--batch-size: must be >= 1, got 0", status 2
        eval_fid.main(["--samples", str(tmp_path / "empty"), "--ref", "digits", "--batch-size", "0"])


def test_inception_without_weights_uses_cleanfids_download_and_names_the_flag_offline(
    eval_fid, tmp_path, monkeypatch
):
    import urllib.error
    import urllib.request

    from mhla_gen.metrics import extractors

    calls = []

    def offline(url, *args, **kwargs):
        calls.append(url)
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(extractors, "cleanfid_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(FileNotFoundError, match=r"--inception-weights"):
        eval_fid.main(["--samples", str(tmp_path), "--ref", "digits", "--extractor", "inception"])
    assert calls == [extractors.INCEPTION_URL]  # clean-fid's standard download was tried
    assert not list(tmp_path.iterdir())  # nothing half-written in the cache
