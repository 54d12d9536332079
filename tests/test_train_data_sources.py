"""Training data as users have it: a ``datasets`` dataset (``data.source=hf``: a save_to_disk folder or a
load_dataset folder) and webdataset-style tar shards (``data.source=shards``), for SANA (captioned
images), Wan (captioned videos) and DiT (class-labelled images, hf). Each source holds the same files as a
local folder, in the same order, so a 2-step run on it must end with exactly the folder run's weights;
and the same start-up checks apply (columns, empty data, unreadable shards, outputs apart from inputs)."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from train_helpers import (
    final_weights,
    max_abs_diff,
    one_per_kind,
    run_inprocess,
    tiny_config,
    training_script,
)

from mhla_gen.bases import BASES
from mhla_gen.errors import ConfigError

# the hf and shards runs against the folder's (three 2-step runs a base): one base of each kind of sample
# (image, video) among those fine-tuned from captions that read both sources
SOURCE_BASES = one_per_kind(b for b in BASES.values() if b.trains and b.conditioning == "captions"
                            and {"folder", "hf", "shards"} <= set(b.data_sources))
SANA = BASES["sana"].name  # the load_dataset imagefolder and the caption-source checks
CAPTIONS = ["a red cat", "a blue dog", "a small cat", "a green dog"]


def _tar(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Tiny checkpoints of :data:`SOURCE_BASES` (and SANA); 4 captioned PNGs and 2 captioned MP4s as a
    folder, a save_to_disk dataset (captions in a ``prompt`` column), an imagefolder for load_dataset, and
    tar shards (2 + 1 items per shard, plus a key without caption that is left out); 20 class-labelled 8x8
    PNGs as class folders and as a datasets dataset with a ClassLabel column."""
    import datasets
    import imageio.v3 as iio
    from PIL import Image

    root = tmp_path_factory.mktemp("sources")
    for name in dict.fromkeys([SANA, *SOURCE_BASES]):
        BASES[name].tiny.load().pipeline().save_pretrained(root / name)
    rng = np.random.default_rng(0)
    for kind, suffix, count in (("images", ".png", 4), ("videos", ".mp4", 2)):
        folder = root / kind
        folder.mkdir()
        media = []
        for i in range(count):
            path = folder / f"{i}{suffix}"
            if kind == "images":
                Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(path)
            else:
                frames = rng.integers(0, 255, (5, 32, 32, 3), dtype=np.uint8)
                iio.imwrite(path, frames, fps=8, codec="libx264", plugin="pyav")
            (folder / f"{i}.txt").write_text(CAPTIONS[i])
            media.append(path.read_bytes())
        column = "image" if kind == "images" else "video"
        table = {column: media, "prompt": CAPTIONS[:count]}
        dataset = datasets.Dataset.from_dict(table)
        if kind == "images":
            dataset = dataset.cast_column("image", datasets.Image())
        dataset.save_to_disk(str(root / f"hf_{kind}"))
        (root / f"shards_{kind}").mkdir()
        pairs = {f"{i:03d}{suffix}": m for i, m in enumerate(media)} | {
            f"{i:03d}.txt": c.encode() for i, c in enumerate(CAPTIONS[:count])
        }
        names = sorted(pairs)
        _tar(root / f"shards_{kind}" / "a-000.tar", {n: pairs[n] for n in names[:4]})
        _tar(root / f"shards_{kind}" / "a-001.tar", {n: pairs[n] for n in names[4:]} | {"999.png": media[0]})
    load_folder = root / "imagefolder"
    load_folder.mkdir()
    with open(load_folder / "metadata.jsonl", "w") as f:
        for i in range(4):
            (load_folder / f"{i}.png").write_bytes((root / "images" / f"{i}.png").read_bytes())
            f.write(json.dumps({"file_name": f"{i}.png", "text": CAPTIONS[i]}) + "\n")
    _class_data(root, rng)
    return root


def _class_data(root, rng) -> None:
    import datasets
    from PIL import Image

    images, labels = [], []
    for label in range(10):
        (root / "classes" / f"c{label}").mkdir(parents=True)
        for j in range(2):
            path = root / "classes" / f"c{label}" / f"{j}.png"
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(path)
            images.append(path.read_bytes())
            labels.append(label)
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    table = {"img": [{"bytes": b, "path": None} for b in images], "label": labels}
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(root / "hf_classes"))


def finetune(base: str, root, out, *overrides):
    run_inprocess(
        training_script(base), "--config", tiny_config(base),
        f"model.pretrained={root / base}", f"output_dir={out}", "train.max_steps=2", "log.sample_every=0",
        *overrides,
    )


def _media(base: str) -> str:
    return "videos" if BASES[base].video else "images"


@pytest.fixture(scope="module")
def folder_weights(sources, tmp_path_factory):
    """``folder_weights(base)``: final weights of the 2-step run on the plain folder (run once per base)."""
    done = {}

    def weights(base: str) -> dict:
        if base not in done:
            out = tmp_path_factory.mktemp(f"folder_{base}")
            finetune(base, sources, out, f"data.path={sources / _media(base)}")
            done[base] = final_weights(out)
        return done[base]

    return weights


@pytest.mark.parametrize("base", SOURCE_BASES)
def test_hf_and_shards_train_exactly_like_the_folder(sources, folder_weights, tmp_path, base):
    media = _media(base)
    column = "data.video_column=video" if BASES[base].video else "data.image_column=image"
    finetune(base, sources, tmp_path / "hf", "data.source=hf", f"data.path={sources / f'hf_{media}'}",
             column, "data.caption_column=prompt")
    finetune(base, sources, tmp_path / "shards", "data.source=shards",
             f"data.path={sources / f'shards_{media}' / 'a-*.tar'}")
    assert max_abs_diff(final_weights(tmp_path / "hf"), folder_weights(base)) == 0.0
    assert max_abs_diff(final_weights(tmp_path / "shards"), folder_weights(base)) == 0.0


def test_load_dataset_folder_trains_like_the_folder(sources, folder_weights, tmp_path):
    """An imagefolder (images + metadata.jsonl) read through load_dataset, split train."""
    finetune(SANA, sources, tmp_path / "hf", "data.source=hf", f"data.path={sources / 'imagefolder'}")
    assert max_abs_diff(final_weights(tmp_path / "hf"), folder_weights(SANA)) == 0.0


def test_dit_class_labelled_hf_dataset_trains_like_class_folders(sources, tmp_path):
    args = ("--config", tiny_config("dit"), "train.max_steps=2",
            "log.sample_every=0", "data.vae=null", "train.global_batch_size=4")
    run_inprocess("train_dit.py", *args, "data.source=folder", f"data.path={sources / 'classes'}",
                  f"output_dir={tmp_path / 'folder'}")
    run_inprocess("train_dit.py", *args, "data.source=hf", f"data.path={sources / 'hf_classes'}",
                  "data.image_column=img", f"output_dir={tmp_path / 'hf'}")
    assert max_abs_diff(final_weights(tmp_path / "hf"), final_weights(tmp_path / "folder")) == 0.0


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (("data.source=hf", "data.path={root}/hf_images", "data.caption_column=text"), ConfigError,
         r"data.caption_column='text' is not a column of .*its columns: \['image', 'prompt'\]"),
        (("data.source=hf", "data.path={root}/imagefolder", "data.split=validation"), ConfigError,
         "Unknown split"),
        (("data.source=hf", "data.path={root}/nothing_here"), ConfigError, "cannot be loaded"),
        (("data.source=shards", "data.path={root}/images"), FileNotFoundError, "no .tar shards"),
        (("data.source=shards", "data.path={root}/bz2"), ConfigError, "not a readable tar shard"),
        (("data.source=shards", "data.path={root}/shards_images/a-*.tar",
          "data.cache_dir={root}/shards_images/cache"), ConfigError, "is inside data.path"),
    ],
)
def test_sources_are_checked_before_any_work(sources, tmp_path, overrides, error, message):
    import bz2

    if not (sources / "bz2").exists():  # (gzip-compressed shards are read: tests/test_train_features.py)
        (sources / "bz2").mkdir()
        shard = (sources / "shards_images" / "a-000.tar").read_bytes()
        (sources / "bz2" / "x.tar").write_bytes(bz2.compress(shard))
    out = tmp_path / "run"
    with pytest.raises(error, match=message):
        finetune(SANA, sources, out, *(o.format(root=sources) for o in overrides))
    assert not out.exists()


def test_dit_hf_class_count_is_checked(sources, tmp_path):
    message = r"model.num_classes=7 but .* has 10 classes \(its 'label' column\)"
    with pytest.raises(ConfigError, match=message):
        run_inprocess("train_dit.py", "--config", tiny_config("dit"),
                      "data.source=hf", f"data.path={sources / 'hf_classes'}", "data.image_column=img",
                      "data.vae=null", "model.num_classes=7", f"output_dir={tmp_path / 'run'}")
    assert not (tmp_path / "run").exists()
