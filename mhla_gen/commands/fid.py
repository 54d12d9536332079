r"""Score a folder / .npz of generated images against a reference: FID, sFID, KID, IS, precision, recall.

    mhla-gen fid --samples samples/x --ref digits                    # writes samples/x.fid.json
    mhla-gen fid --samples samples.npz --ref VIRTUAL_imagenet256_labeled.npz \
        --extractor inception --inception-weights ~/weights/inception-2015-12-05.pt

--samples / --ref: a folder of images (PNG/JPEG, searched recursively), an ``.npz`` whose ``arr_0``
is uint8 NHWC (ADM / DiT sample_ddp format), or for --ref a statistics ``.npz`` written by
--save-ref-stats (``mu``/``sigma``, plus features for KID and precision/recall) or ``digits``
(scikit-learn's embedded digits). Offline, ``--extractor digits`` (a small CNN trained in seconds and
cached) replaces Inception; its numbers are only comparable with themselves.

Outputs: the metrics JSON (default ``<samples>.fid.json`` beside the samples: ``samples/x.fid.json`` for
a folder, ``x/samples.fid.json`` for ``x/samples.npz``) and, with ``--save-ref-stats``, a statistics
``.npz``. Both are checked before any work and replace an existing file only if this script wrote it
(a record inside the file says so) or ``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mhla_gen.commands.cli import expand_path, run
from mhla_gen.data.digits import digits_tensors
from mhla_gen.errors import ConfigError
from mhla_gen.metrics.extractors import digits_extractor, extract_features, inception_extractor
from mhla_gen.metrics.fid import (
    REFERENCE_STATS,
    feature_statistics,
    frechet_distance,
    inception_score,
    kernel_inception_distance,
    load_reference_stats,
    precision_recall,
    save_reference_stats,
)
from mhla_gen.outputs.folders import check_apart, check_file_target, file_record
from mhla_gen.outputs.locks import writing_files
from mhla_gen.train.io import atomic_write_text

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
METRICS_KIND = "fid_metrics"  # the record in the metrics JSON (mhla_gen.outputs.folders.file_record)


def load_images(source: str | Path, limit: int | None = None) -> torch.Tensor:
    """Images ``(N, C, H, W)`` uint8 from a folder, an ``arr_0`` .npz, or ``digits`` (kept as uint8 until
    extract_features converts each batch: 50k ImageNet samples are 10 GB as uint8, 39 GB as float)."""
    if str(source) == "digits":
        return (digits_tensors(16)[0][:limit] * 255).round().to(torch.uint8)
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")  # hidden files: generate.py's unfinished temporaries
                       if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))[:limit]
        if not files:
            raise FileNotFoundError(f"no images ({sorted(IMAGE_SUFFIXES)}) under {str(path)!r}")
        arrays = [np.asarray(Image.open(f).convert("RGB")) for f in files]
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1:
            raise ValueError(f"images under {str(path)!r} have different sizes {sorted(shapes)}")
        arr = np.stack(arrays)
    elif path.suffix == ".npz":
        with np.load(path) as data:
            if "arr_0" not in data:
                raise ValueError(f"{str(path)!r} has no 'arr_0' image array (keys: {sorted(data.keys())})")
            arr = data["arr_0"][:limit]
        if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] not in (1, 3):
            raise ValueError(f"'arr_0' in {str(path)!r} must be uint8 NHWC, got {arr.dtype} {arr.shape}")
    else:
        raise FileNotFoundError(f"--samples/--ref must be a folder, an .npz or 'digits', got {str(path)!r}")
    return torch.from_numpy(arr).permute(0, 3, 1, 2)


def is_stats_file(source: str | Path) -> bool:
    if not str(source).endswith(".npz") or not Path(source).is_file():
        return False
    with np.load(source) as data:
        return "mu" in data.files and "arr_0" not in data.files


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_extractor(name: str, inception_weights: str | None, seed: int):
    if name == "digits":
        return digits_extractor(seed=seed)
    if name == "inception":  # no --inception-weights: clean-fid's own download and cache
        return inception_extractor(inception_weights)
    raise ValueError(f"unknown extractor {name!r}; choose digits or inception")


def score(fake: dict[str, np.ndarray], ref: dict[str, np.ndarray], k: int = 3,
          kid_subsets: int = 100) -> dict:
    """All metrics from fake features and reference features/statistics (keys as in extract_features /
    load_reference_stats: ``pool``/``features``, ``logits``, ``spatial``, ``mu``, ``sigma``, ...)."""
    ref_pool = ref.get("pool", ref.get("features"))
    mu_r, sigma_r = (ref["mu"], ref["sigma"]) if "mu" in ref else feature_statistics(ref_pool)
    out = {"fid": frechet_distance(*feature_statistics(fake["pool"]), mu_r, sigma_r)}
    if "spatial" in fake and ("spatial" in ref or "mu_s" in ref):
        mu_s, sigma_s = (ref["mu_s"], ref["sigma_s"]) if "mu_s" in ref else feature_statistics(ref["spatial"])
        out["sfid"] = frechet_distance(*feature_statistics(fake["spatial"]), mu_s, sigma_s)
    if "logits" in fake:
        out["inception_score"], out["inception_score_std"] = inception_score(fake["logits"])
    if ref_pool is not None:
        out["kid"], out["kid_std"] = kernel_inception_distance(ref_pool, fake["pool"], kid_subsets)
        out["precision"], out["recall"] = precision_recall(ref_pool, fake["pool"], k=k)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", required=True, type=expand_path,
                        help="folder of images or .npz (arr_0 uint8 NHWC)")
    parser.add_argument("--ref", required=True, type=expand_path,
                        help="folder, .npz images, .npz statistics, or 'digits'")
    parser.add_argument("--extractor", default="digits", choices=["digits", "inception"])
    parser.add_argument("--inception-weights", default=None, type=expand_path,
                        help="local inception-2015-12-05.pt (default: clean-fid downloads it to its cache)")
    parser.add_argument("--extractor-seed", type=int, default=0, help="digits extractor seed")
    parser.add_argument("--num", type=positive_int, default=None,
                        help="use at most this many samples / ref images")
    parser.add_argument("--k", type=positive_int, default=3,
                        help="k of the k-NN manifolds (precision/recall)")
    parser.add_argument("--kid-subsets", type=positive_int, default=100)
    parser.add_argument("--batch-size", type=positive_int, default=128)
    parser.add_argument("--save-ref-stats", default=None, type=expand_path,
                        help="write the reference statistics .npz here")
    parser.add_argument("--out", default=None, type=expand_path,
                        help="metrics JSON (default: <samples>.fid.json beside the samples)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out / --save-ref-stats even if this script did not write them")
    args = parser.parse_args(argv)

    out, stats_out = check_outputs(args)  # before any work
    with writing_files((out, "--out"), (stats_out, "--save-ref-stats")):  # one writer per file
        extractor = build_extractor(args.extractor, args.inception_weights, args.extractor_seed)
        fake_images = load_images(args.samples, args.num)
        fake = extract_features(extractor, fake_images, args.batch_size)
        if is_stats_file(args.ref):
            ref = load_reference_stats(args.ref)
            saved_by = str(ref.get("extractor", "unknown"))
            if saved_by not in ("unknown", extractor.name):
                raise ValueError(f"{args.ref!r} holds {saved_by!r} statistics but the extractor is "
                                 f"{extractor.name!r}")
            num_ref = len(ref["features"]) if "features" in ref else None
        else:
            ref_images = load_images(args.ref, args.num)
            ref = extract_features(extractor, ref_images, args.batch_size)
            num_ref = len(ref_images)
            if stats_out is not None:
                save_reference_stats(stats_out, ref, extractor.name)

        metrics = score(fake, ref, k=args.k, kid_subsets=args.kid_subsets)
        metrics.update({"extractor": extractor.name, "num_samples": len(fake_images), "num_ref": num_ref,
                        "samples": str(args.samples), "ref": str(args.ref)})
        if hasattr(extractor, "test_accuracy"):
            metrics["extractor_test_accuracy"] = extractor.test_accuracy
        print(json.dumps(metrics, indent=2))  # printed first: a failing write cannot lose the numbers
        atomic_write_text(out, json.dumps({**metrics, **file_record(METRICS_KIND)}, indent=2) + "\n")
        print(f"wrote {out}")
        return metrics


def default_out(samples: str) -> Path:
    """``<samples>.fid.json`` beside the samples (never inside a folder that may not be ours); ``.`` or
    ``..`` is named by the folder it is (``--samples .`` in ``runs/a``: ``runs/a.fid.json``)."""
    path = Path(samples).expanduser()
    if path.name in ("", ".."):
        path = path.resolve()
    if not path.name:
        raise ConfigError(f"--samples {samples!r} has no name to put the metrics beside: give --out")
    return path.with_name(f"{path.stem if path.suffix == '.npz' else path.name}.fid.json")


def check_outputs(args) -> tuple[Path, Path | None]:
    """The metrics JSON and reference-statistics paths, checked before any work (mhla_gen.outputs.folders): an
    existing file is replaced only if this script wrote it or ``--overwrite`` is given."""
    inputs = {"--samples": args.samples, "--ref": args.ref}  # never written into (or replaced)
    out = args.out or default_out(args.samples)
    check_apart(out, "--out", inputs)
    out = check_file_target(out, "--out", METRICS_KIND, args.overwrite)
    stats = None
    if args.save_ref_stats:
        if is_stats_file(args.ref):
            raise ConfigError("--save-ref-stats needs --ref images (a folder, an arr_0 .npz or digits), "
                              "not statistics")
        stats = Path(args.save_ref_stats)
        stats = stats if stats.suffix == ".npz" else stats.with_name(stats.name + ".npz")  # as np.savez
        check_apart(stats, "--save-ref-stats", inputs)
        stats = check_file_target(stats, "--save-ref-stats", REFERENCE_STATS, args.overwrite)
    return out, stats


if __name__ == "__main__":
    run(main)
