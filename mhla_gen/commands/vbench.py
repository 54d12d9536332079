r"""VBench-style scores for a folder of MP4s: per-video and aggregated JSON.

    mhla-gen vbench --videos samples/wan                 # writes samples/wan.vbench.json
    mhla-gen vbench --videos DIR --subject-model ~/w/dino-vitb16 --background-model ~/w/clip-vit-b32 \
        --raft-weights ~/w/raft_large_C_T_V2-1bb1363a.pth --aesthetic-clip ~/w/clip-vit-l14 \
        --aesthetic-head ~/w/sa_0_4_vit_l_14_linear.pth
    mhla-gen vbench --videos DIR --use-vbench --vbench-info VBench_full_info.json   # the real package

Dimensions and which ones are proxies: see ``mhla_gen/metrics/video.py``. Offline defaults: pixel-
correlation features for the consistency dimensions, phase-correlation flow for dynamic degree, linear
interpolation for motion smoothness; each JSON records the extractor / estimator used. The JSON
(default ``<videos>.vbench.json`` beside the folder) replaces an existing file only if this script wrote
it or ``--overwrite`` is given; that is checked before any work.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from mhla_gen.commands.cli import expand_path, run
from mhla_gen.metrics.extractors import digits_extractor, hf_image_extractor, pixel_extractor
from mhla_gen.metrics.video import evaluate_video, raft_flow, read_video
from mhla_gen.outputs.folders import check_apart, check_file_target, file_record
from mhla_gen.outputs.locks import writing_files
from mhla_gen.train.io import atomic_write_text

VIDEO_SUFFIXES = {".mp4", ".webm", ".mkv", ".avi", ".mov", ".gif"}
METRICS_KIND = "vbench_metrics"  # the record in the JSON (mhla_gen.outputs.folders.file_record)


def build_feature_extractor(model_path: str | None, fallback: str):
    if model_path:
        return hf_image_extractor(model_path)
    return digits_extractor() if fallback == "digits" else pixel_extractor()


def load_aesthetic(clip_path: str | None, head_path: str | None):
    if not clip_path and not head_path:
        return None
    if not (clip_path and head_path):
        raise ValueError("aesthetic quality needs both --aesthetic-clip and --aesthetic-head")
    state = torch.load(head_path, map_location="cpu")
    state = {k.split(".")[-1]: v for k, v in state.items()}  # LAION files store weight/bias (maybe prefixed)
    head = torch.nn.Linear(state["weight"].shape[1], 1)
    head.load_state_dict(state)
    return hf_image_extractor(clip_path), head.eval()


def _lone_vbench_module(folder: str | Path) -> bool:
    """``import vbench`` from ``folder`` would find a single ``vbench.py`` (a script such as the checkout's
    ``eval/vbench.py``), not the installed package (a folder ``vbench/``, which Python prefers)."""
    folder = Path(folder or ".")
    return (folder / "vbench.py").is_file() and not (folder / "vbench" / "__init__.py").is_file()


def import_vbench_package():
    """The installed ``vbench`` package. Run as ``python eval/vbench.py``, the script's folder is first on
    ``sys.path`` and ``import vbench`` would find the script itself: such folders are left out while
    importing."""
    saved, cached = sys.path[:], sys.modules.get("vbench")
    if cached is not None and Path(getattr(cached, "__file__", None) or "").name == "vbench.py":
        del sys.modules["vbench"]  # a script imported under the package's name
    sys.path[:] = [p for p in sys.path if not _lone_vbench_module(p)]
    try:
        if importlib.util.find_spec("vbench") is None:
            raise ModuleNotFoundError("--use-vbench needs the `vbench` package (pip install vbench)")
        import vbench
    finally:
        sys.path[:] = saved
    return vbench


def run_official_vbench(args) -> dict:
    """Hand the folder to the real ``vbench`` package (its own model downloads / caches apply) and return
    its results. It writes fixed names (``<name>_eval_results.json``, ``<name>_full_info.json``) into the
    folder it is given, so it gets a temporary folder of its own, not the folder ``--out`` lies in: a
    user's files of those names are never replaced, and an earlier run's results are never read back."""
    VBench = import_vbench_package().VBench

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="mhla_gen-vbench-") as out_dir:
        bench = VBench(device, args.vbench_info, out_dir)
        bench.evaluate(videos_path=args.videos, name="mhla_vbench", dimension_list=args.dimensions,
                       mode="custom_input")
        results = Path(out_dir) / "mhla_vbench_eval_results.json"
        if not results.is_file():
            raise FileNotFoundError(f"the vbench package wrote no {results.name} for --videos "
                                    f"{str(args.videos)!r} (dimensions {args.dimensions})")
        return json.loads(results.read_text())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos", required=True, type=expand_path,
                        help="folder of videos (searched recursively)")
    parser.add_argument("--out", default=None, type=expand_path,
                        help="JSON path (default: <videos>.vbench.json beside the folder)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out even if this script did "
                        "not write it")
    parser.add_argument("--extractor", default="pixels", choices=["pixels", "digits"],
                        help="offline consistency features when no --subject/--background-model is given")
    parser.add_argument("--subject-model", default=None, help="local transformers DINO folder")
    parser.add_argument("--background-model", default=None, help="local transformers CLIP folder")
    parser.add_argument("--raft-weights", default=None, help="local torchvision RAFT state dict")
    parser.add_argument("--raft-small", action="store_true")
    parser.add_argument("--aesthetic-clip", default=None, help="local CLIP ViT-L/14 folder")
    parser.add_argument("--aesthetic-head", default=None, help="LAION aesthetic linear head (.pth)")
    parser.add_argument("--use-vbench", action="store_true", help="run the official vbench package instead")
    parser.add_argument("--vbench-info", default=None, help="VBench_full_info.json (for --use-vbench)")
    parser.add_argument("--dimensions", nargs="+", default=[
        "subject_consistency", "background_consistency", "temporal_flickering", "motion_smoothness",
        "dynamic_degree", "aesthetic_quality", "imaging_quality"], help="for --use-vbench")
    return parser.parse_args(argv)


def score_folder(args: argparse.Namespace, folder: Path) -> dict:
    """The offline scores of every video under ``folder`` (hidden files left out) with the extractors the
    settings name: per video and their means."""
    videos = sorted(p for p in folder.rglob("*")  # hidden files: generate.py's unfinished temporaries
                    if p.suffix.lower() in VIDEO_SUFFIXES and not p.name.startswith("."))
    if not videos:
        raise FileNotFoundError(f"no videos ({sorted(VIDEO_SUFFIXES)}) under {str(folder)!r}")
    subject = build_feature_extractor(args.subject_model, args.extractor)
    background = None
    if args.background_model:
        background = build_feature_extractor(args.background_model, args.extractor)
    flow_fn = raft_flow(args.raft_weights, args.raft_small) if args.raft_weights else None
    aesthetic = load_aesthetic(args.aesthetic_clip, args.aesthetic_head)

    per_video = []
    for path in videos:
        frames, fps = read_video(path)
        scores = evaluate_video(frames, fps, subject, background, flow_fn, aesthetic)
        name = str(path.relative_to(folder))
        per_video.append({"video": name, "frames": len(frames), "fps": fps, **scores})
    dims = [k for k in per_video[0] if k not in ("video", "frames", "fps")]
    return {
        "aggregate": {k: float(np.mean([v[k] for v in per_video])) for k in dims},
        "num_videos": len(per_video),
        "subject_extractor": subject.name,
        "background_extractor": (background or subject).name,
        "flow": "torchvision-raft" if flow_fn else "phase-correlation-tiles (proxy)",
        "motion_smoothness": "linear interpolation (proxy for VBench's AMT)",
        "per_video": per_video,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    folder = Path(args.videos)
    if not folder.is_dir():
        raise FileNotFoundError(f"--videos {str(folder)!r} is not a folder")
    out = Path(args.out) if args.out else folder.with_name(f"{folder.name}.vbench.json")
    out = check_file_target(out, "--out", METRICS_KIND, args.overwrite)  # before any work
    check_apart(out, "--out", {"--videos": folder})
    with writing_files((out, "--out")):  # one writer per file
        if args.use_vbench:
            result = run_official_vbench(args)
            print(json.dumps(result, indent=2))
            atomic_write_text(out, json.dumps({**result, **file_record(METRICS_KIND)}, indent=2) + "\n")
            return result

        result = score_folder(args, folder)
        print(json.dumps(result["aggregate"], indent=2))  # printed first: a failing write cannot lose them
        atomic_write_text(out, json.dumps({**result, **file_record(METRICS_KIND)}, indent=2) + "\n")
        print(f"wrote {out}")
        return result


if __name__ == "__main__":
    run(main)
