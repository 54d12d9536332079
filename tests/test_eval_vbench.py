"""VBench-style video dimensions on synthetic videos, and eval/vbench.py on a folder of MP4s."""

from pathlib import Path

import numpy as np
import pytest
import torch
from script_helpers import load_script

from mhla_gen.metrics.extractors import pixel_extractor
from mhla_gen.metrics.video import (
    consistency,
    dynamic_degree,
    evaluate_video,
    motion_smoothness_linear_interp_proxy,
    phase_correlation_flow,
    read_video,
    temporal_flickering,
    write_video,
)

ROOT = Path(__file__).resolve().parents[1]
T, H, W = 16, 64, 64


def background(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.random((H, W, 3)) * 60 + 50).astype(np.uint8)


def static_video():
    return np.repeat(background()[None], T, axis=0)


def noise_video():
    return np.random.default_rng(1).integers(0, 256, (T, H, W, 3), dtype=np.uint8)


def moving_square(step=3):
    video = static_video().copy()
    for t in range(T):
        video[t, 20:36, 4 + step * t : 20 + step * t] = 255
    return video


def test_static_video_scores():
    scores = evaluate_video(static_video(), 8.0, pixel_extractor())
    assert scores["temporal_flickering"] == 1.0
    assert scores["motion_smoothness_linear_interp_proxy"] == 1.0
    assert scores["subject_consistency"] == pytest.approx(1.0)
    assert scores["dynamic_degree_phasecorr_proxy"] == 0.0 and scores["mean_top5_flow_px"] == 0.0


def test_temporal_flickering_matches_vbench_formula():
    video = static_video()
    video[1::2] = np.clip(video[1::2].astype(int) + 10, 0, 255).astype(np.uint8)  # +10 every other frame
    assert temporal_flickering(video) == pytest.approx((255 - 10) / 255)
    # linear interpolation of the even frames reproduces the odd frames up to the 10-level flicker
    assert motion_smoothness_linear_interp_proxy(video) == pytest.approx((255 - 10) / 255)


def test_noise_video_is_inconsistent_and_square_moves():
    ext = pixel_extractor()
    noise, square = evaluate_video(noise_video(), 8.0, ext), evaluate_video(moving_square(), 8.0, ext)
    assert noise["subject_consistency"] < 0.1 < square["subject_consistency"] < 1.0
    assert noise["temporal_flickering"] < square["temporal_flickering"] < 1.0
    assert square["dynamic_degree_phasecorr_proxy"] == 1.0 and square["mean_top5_flow_px"] > 1.5


def test_consistency_formula_clamps_negative_similarity():
    feats = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [1.0, 0.0]])
    # frame 1: prev -1 -> 0, first -1 -> 0; frame 2: prev -1 -> 0, first 1 -> 1  => mean(0, 0.5)
    assert consistency(feats) == pytest.approx(0.25)


def test_phase_correlation_recovers_a_global_shift():
    img = torch.from_numpy(background(3)).permute(2, 0, 1).float()[None] * 2
    shifted = torch.roll(img, shifts=(2, -3), dims=(2, 3))  # dy = 2, dx = -3
    flow = phase_correlation_flow(img, shifted, tile=32)
    assert flow[0, 0].median().item() == -3 and flow[0, 1].median().item() == 2


def test_dynamic_degree_thresholds_follow_vbench():
    result = dynamic_degree(moving_square(), fps=8.0)
    assert result["threshold"] == pytest.approx(6.0 * 64 / 256) and result["count_needed"] == 4
    slow = dynamic_degree(moving_square(step=1), fps=8.0)
    assert not slow["dynamic"]  # 1 px/frame is below 1.5 px


def test_mp4_roundtrip_lossless(tmp_path):
    video = moving_square()
    write_video(tmp_path / "a.mp4", video, fps=8, lossless=True)
    frames, fps = read_video(tmp_path / "a.mp4")
    assert fps == 8.0 and np.array_equal(frames, video)


def test_vbench_cli_on_a_folder(tmp_path):
    module = load_script(ROOT / "eval" / "vbench.py", "eval_vbench")
    videos = tmp_path / "videos"
    videos.mkdir()
    write_video(videos / "static.mp4", static_video(), fps=8, lossless=True)
    write_video(videos / "square.mp4", moving_square(), fps=8, lossless=True)
    result = module.main(["--videos", str(videos)])
    assert (tmp_path / "videos.vbench.json").exists() and result["num_videos"] == 2
    assert result["aggregate"]["dynamic_degree_phasecorr_proxy"] == 0.5
    assert result["subject_extractor"].startswith("pixels")
    with pytest.raises(FileNotFoundError, match="empty"):
        (tmp_path / "empty").mkdir()
        module.main(["--videos", str(tmp_path / "empty")])


def test_hf_extractor_from_a_local_folder(tmp_path):
    """A tiny random ViT saved locally stands in for DINO: the consistency path runs on its CLS features."""
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    from mhla_gen.metrics.extractors import hf_image_extractor

    config = ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=32)
    ViTModel(config).save_pretrained(tmp_path / "vit")
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path / "vit")
    extractor = hf_image_extractor(tmp_path / "vit")
    assert extractor.name == "hf:vit:vit"
    scores = evaluate_video(static_video(), 8.0, extractor)
    assert scores["subject_consistency"] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_image_extractor(tmp_path / "missing")


def test_raft_and_aesthetic_paths_with_local_random_weights(tmp_path):
    """The model-backed paths load local files: RAFT (random weights: checks plumbing and shapes only) and
    the aesthetic head on a tiny random CLIP."""
    from torchvision.models.optical_flow import raft_small
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from mhla_gen.metrics.extractors import hf_image_extractor
    from mhla_gen.metrics.video import raft_flow

    torch.manual_seed(0)
    torch.save(raft_small(weights=None).state_dict(), tmp_path / "raft.pth")
    flow_fn = raft_flow(tmp_path / "raft.pth", small=True, iters=1)
    frames = torch.from_numpy(moving_square()[:2]).permute(0, 3, 1, 2).float()
    assert flow_fn(frames[:1], frames[1:]).shape == (1, 2, H, W)
    with pytest.raises(FileNotFoundError, match="RAFT weights"):
        raft_flow(tmp_path / "missing.pth")

    config = CLIPConfig(
        text_config=dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2),
        projection_dim=8)
    CLIPModel(config).save_pretrained(tmp_path / "clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        tmp_path / "clip")
    head = torch.nn.Linear(8, 1)
    module = load_script(ROOT / "eval" / "vbench.py", "eval_vbench")
    torch.save(head.state_dict(), tmp_path / "head.pth")
    aesthetic = module.load_aesthetic(str(tmp_path / "clip"), str(tmp_path / "head.pth"))
    scores = evaluate_video(static_video()[:3], 8.0, pixel_extractor(), flow_fn=flow_fn, aesthetic=aesthetic)
    assert "dynamic_degree" in scores and np.isfinite(scores["aesthetic_quality"])
    clip = hf_image_extractor(tmp_path / "clip")
    first = torch.from_numpy(static_video()[:1]).permute(0, 3, 1, 2).float() / 255  # all frames are equal
    feats = torch.nn.functional.normalize(clip(first)["pool"], dim=-1)
    assert scores["aesthetic_quality"] == pytest.approx(head(feats).item() / 10, abs=1e-5)


def test_use_vbench_imports_the_package_not_this_script(tmp_path, monkeypatch):
    """`python eval/vbench.py` puts eval/ first on sys.path, where `import vbench` finds the script."""
    package = tmp_path / "site" / "vbench"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("class VBench:\n    installed = True\n")
    script = load_script(ROOT / "eval" / "vbench.py", "eval_vbench_import")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(ROOT / "eval"))  # as when run as a script: the script's folder first
    monkeypatch.delitem(__import__("sys").modules, "vbench", raising=False)
    assert script.import_vbench_package().VBench.installed
    assert str(ROOT / "eval") == __import__("sys").path[0]  # sys.path restored


FAKE_VBENCH = '''import json, os

class VBench:
    """The real package's interface: results under fixed names in the folder it is given."""

    def __init__(self, device, full_info_dir, output_path):
        self.output_path = output_path
        os.makedirs(output_path, exist_ok=True)

    def evaluate(self, videos_path, name, dimension_list=None, mode="vbench_standard", **kwargs):
        results = {dim: [0.5, []] for dim in dimension_list}
        for suffix, record in (("eval_results", results), ("full_info", [])):
            with open(os.path.join(self.output_path, f"{name}_{suffix}.json"), "w") as f:
                json.dump(record, f)
'''


def test_use_vbench_writes_only_out_never_beside_it(tmp_path, monkeypatch):
    """The real package writes ``mhla_vbench_eval_results.json`` / ``_full_info.json`` into the folder it is
    given: a temporary one, so the user's files of those names beside ``--out`` stay as they were, and an
    earlier run's results are not read back; the scores land in ``--out`` only."""
    package = tmp_path / "site" / "vbench"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VBENCH)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(__import__("sys").modules, "vbench", raising=False)
    module = load_script(ROOT / "eval" / "vbench.py", "eval_vbench_official")
    videos = tmp_path / "videos"
    videos.mkdir()
    write_video(videos / "static.mp4", static_video(), fps=8, lossless=True)
    mine = tmp_path / "mhla_vbench_eval_results.json"
    mine.write_text("the user's own file\n")
    result = module.main(["--videos", str(videos), "--use-vbench", "--dimensions", "imaging_quality"])
    assert result == {"imaging_quality": [0.5, []]}
    assert mine.read_text() == "the user's own file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [mine.name, "site", "videos", "videos.vbench.json"]
