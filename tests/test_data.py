"""Datasets: digits, class folders (ADM crop), captioned images / videos, latent and feature caches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from mhla_gen.data import (
    CaptionedImageFolder,
    CaptionedVideoFolder,
    ClassFolderDataset,
    FeatureCacheDataset,
    LatentCacheDataset,
    build_feature_cache,
    center_crop_arr,
    digits_tensors,
    write_class_latents,
)


def _png(path, h, w, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path)


def _mp4(path, frames=6, h=24, w=32, seed=0):
    import imageio.v3 as iio

    arr = np.random.default_rng(seed).integers(0, 255, (frames, h, w, 3), dtype=np.uint8)
    iio.imwrite(path, arr, fps=8, codec="libx264", plugin="pyav")


@pytest.mark.parametrize("resolution", [8, 16, 24])
def test_digits_tensors(resolution):
    images, labels = digits_tensors(resolution)
    assert images.shape == (1797, 1, resolution, resolution) and images.dtype == torch.float32
    assert labels.shape == (1797,) and labels.dtype == torch.long
    assert 0.0 <= images.min() and images.max() <= 1.0 and images.max() > 0.9
    assert sorted(labels.unique().tolist()) == list(range(10))


def test_digits_native_resolution_is_the_raw_data():
    from sklearn.datasets import load_digits

    images, _ = digits_tensors(8)
    torch.testing.assert_close(images[:, 0], torch.from_numpy(load_digits().images).float() / 16)


def test_center_crop_matches_adm():
    image = Image.fromarray(np.arange(70 * 40 * 3, dtype=np.uint8).reshape(40, 70, 3))
    out = center_crop_arr(image, 16)  # 40x70 -> BOX halve to 20x35 -> bicubic 16x28 -> centre 16x16
    assert out.size == (16, 16)
    expected = np.array(image.resize((35, 20), Image.BOX).resize((28, 16), Image.BICUBIC))[:, 6:22]
    np.testing.assert_array_equal(np.array(out), expected)


def test_class_folder_labels_crop_and_bad_file(tmp_path, caplog):
    for i, (cls, h, w) in enumerate([("b_dog", 20, 30), ("a_cat", 33, 17), ("a_cat", 16, 16)]):
        _png(tmp_path / cls / f"{i}.png", h, w, seed=i)
    (tmp_path / "b_dog" / "broken.png").write_bytes(b"not a png")
    ds = ClassFolderDataset(tmp_path, 8)
    assert ds.classes == ["a_cat", "b_dog"] and len(ds) == 4
    items = [ds[i] for i in range(len(ds))]
    assert all(it["pixels"].shape == (3, 8, 8) for it in items)
    assert all(-1.0 <= it["pixels"].min() and it["pixels"].max() <= 1.0 for it in items)
    assert [int(it["class_labels"]) for it in items[:2]] == [0, 0]
    assert ds.skipped == 1 and "broken.png" in caplog.text  # fell through to the next readable file


def test_missing_folders_raise_named_errors(tmp_path):
    for make in (
        lambda p: ClassFolderDataset(p, 8),
        lambda p: CaptionedImageFolder(p, 8, 8),
        lambda p: CaptionedVideoFolder(p, 5, 8, 8),
        lambda p: LatentCacheDataset(p),
    ):
        with pytest.raises(FileNotFoundError, match="nowhere"):
            make(tmp_path / "nowhere")


def test_captioned_images_from_jsonl_and_side_files(tmp_path):
    _png(tmp_path / "a.png", 20, 30)
    _png(tmp_path / "sub" / "b.jpg", 40, 40)
    _png(tmp_path / "c.png", 10, 10)  # no caption: left out
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "text": "a red cat"}) + "\n")
    (tmp_path / "sub" / "b.txt").write_text("a blue dog\n")
    ds = CaptionedImageFolder(tmp_path, 16, 24)
    assert [ds[i]["caption"] for i in range(len(ds))] == ["a red cat", "a blue dog"]
    assert ds[0]["pixels"].shape == (3, 16, 24)


def test_captioned_videos_decode_and_skip(tmp_path, caplog):
    _mp4(tmp_path / "v0.mp4", frames=6)
    (tmp_path / "v0.txt").write_text("a cat runs")
    _mp4(tmp_path / "v1.mp4", frames=3)  # too short for 5 frames
    (tmp_path / "v1.txt").write_text("a dog swims")
    (tmp_path / "v2.mp4").write_bytes(b"\x00garbage")
    (tmp_path / "v2.txt").write_text("a bird flies")
    ds = CaptionedVideoFolder(tmp_path, 5, 16, 16)
    assert len(ds) == 3
    item = ds.load(0)
    assert item["pixels"].shape == (3, 5, 16, 16) and item["caption"] == "a cat runs"
    for bad in (1, 2):
        with pytest.raises(Exception):  # noqa: B017 - decoders raise various types
            ds.load(bad)
    assert ds[1]["caption"] == "a cat runs" and ds.skipped == 2  # v1, v2 skipped, wrapped to v0
    with pytest.raises(ValueError, match="4k"):
        CaptionedVideoFolder(tmp_path, 4, 16, 16)


def test_class_latent_cache_roundtrip(tmp_path):
    for i in range(3):
        _png(tmp_path / "data" / f"c{i % 2}" / f"{i}.png", 16, 16, seed=i)
    (tmp_path / "data" / "c1" / "bad.png").write_bytes(b"oops")
    ds = ClassFolderDataset(tmp_path / "data", 8)

    def encode(x):  # stand-in VAE: 2x average pooling
        return torch.nn.functional.avg_pool2d(x, 2)

    out = write_class_latents(ds, encode, tmp_path / "cache", {"vae": "avgpool"}, batch_size=2)
    cache = LatentCacheDataset(out)
    assert len(cache) == 3 and cache.meta["skipped"] == 1 and cache.meta["vae"] == "avgpool"
    item = cache[0]
    assert item["latents"].shape == (2, 3, 4, 4)
    torch.testing.assert_close(item["latents"][1], item["latents"][0].flip(-1), atol=2e-3, rtol=0)
    torch.testing.assert_close(item["latents"][0], encode(ds.load(0)["pixels"][None])[0], atol=2e-3, rtol=0)
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_feature_cache_reuse_and_rebuild(tmp_path):
    _png(tmp_path / "d" / "a.png", 8, 8)
    (tmp_path / "d" / "a.txt").write_text("a cat")
    ds = CaptionedImageFolder(tmp_path / "d", 8, 8)
    calls = []

    def encode(item):
        calls.append(item["caption"])
        return {"latents": item["pixels"][:, ::2, ::2], "prompt_embeds": torch.ones(3, 4)}

    build_feature_cache(ds, encode, tmp_path / "c", {"v": 1})
    build_feature_cache(ds, encode, tmp_path / "c", {"v": 1})  # same fingerprint: reused
    assert calls == ["a cat"]
    build_feature_cache(ds, encode, tmp_path / "c", {"v": 2})  # changed: rebuilt
    assert calls == ["a cat", "a cat"]
    item = FeatureCacheDataset(tmp_path / "c")[0]
    assert item["latents"].shape == (3, 4, 4) and item["prompt_embeds"].shape == (3, 4)


# ------------------------------------------------------------------ caches never delete what is not theirs
def _avgpool(x):  # stand-in VAE
    return torch.nn.functional.avg_pool2d(x, 2)


def _class_folder(root):
    for i in range(2):
        _png(root / f"c{i}" / f"{i}.png", 16, 16, seed=i)
    return ClassFolderDataset(root, 8)


def _tree(root):
    """Every file under ``root`` with its bytes: what a refused call must leave untouched."""
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["equal", "inside", "containing"])
def test_latent_cache_refuses_to_overlap_the_data(tmp_path, where):
    from mhla_gen.errors import ConfigError

    data = tmp_path / "data"
    ds = _class_folder(data)
    out = {"equal": data, "inside": data / "c0" / "cache", "containing": tmp_path}[where]
    before = _tree(tmp_path)
    with pytest.raises(ConfigError, match=r"--out=.* (is|is inside|contains) --data="):
        write_class_latents(ds, _avgpool, out, {}, settings=("--out", "--data"))
    assert _tree(tmp_path) == before


def test_caches_refuse_a_folder_with_other_files(tmp_path):
    from mhla_gen.errors import ConfigError

    ds = _class_folder(tmp_path / "data")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"out_dir=.*out'.* not empty .*notes\.txt"):
        write_class_latents(ds, _avgpool, tmp_path / "out", {})
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"

    captioned = tmp_path / "captioned"
    _png(captioned / "a.png", 8, 8)
    (captioned / "a.txt").write_text("a cat")
    caption_ds = CaptionedImageFolder(captioned, 8, 8)
    encode = lambda item: {"latents": item["pixels"]}
    with pytest.raises(ConfigError, match=r"cache_dir=.*notes\.txt"):
        build_feature_cache(caption_ds, encode, tmp_path / "out", {"v": 1})
    with pytest.raises(ConfigError, match="is data.path"):
        build_feature_cache(caption_ds, encode, captioned, {"v": 1})
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and (captioned / "a.txt").exists()

    # a cache of one kind is not a cache of the other kind
    write_class_latents(ds, _avgpool, tmp_path / "latents", {})
    with pytest.raises(ConfigError, match="latent_cache folder of mhla_gen, not a feature_cache"):
        build_feature_cache(caption_ds, encode, tmp_path / "latents", {"v": 1})
    # a file the user added to a cache is not deleted with it either
    (tmp_path / "latents" / "readme.md").write_text("mine")
    with pytest.raises(ConfigError, match="readme.md"):
        write_class_latents(ds, _avgpool, tmp_path / "latents", {})
    assert (tmp_path / "latents" / "readme.md").exists()


def test_caches_are_replaced_when_they_are_ours(tmp_path):
    ds = _class_folder(tmp_path / "data")
    write_class_latents(ds, _avgpool, tmp_path / "latents", {"run": 1})
    write_class_latents(ds, _avgpool, tmp_path / "latents", {"run": 2})  # our own: replaced
    assert LatentCacheDataset(tmp_path / "latents").meta["run"] == 2
    (tmp_path / "empty").mkdir()
    write_class_latents(ds, _avgpool, tmp_path / "empty", {})  # an empty folder is fine too
    # a leftover temporary folder is deleted only if it is ours
    (tmp_path / ".tmp-fresh").mkdir()
    (tmp_path / ".tmp-fresh" / "photo.png").write_bytes(b"mine")
    from mhla_gen.errors import ConfigError

    with pytest.raises(ConfigError, match=r"temporary folder.*photo\.png"):
        write_class_latents(ds, _avgpool, tmp_path / "fresh", {})
    assert (tmp_path / ".tmp-fresh" / "photo.png").read_bytes() == b"mine"


@pytest.mark.parametrize("size", [0, -8])
def test_bad_sizes_are_named_not_reported_as_unreadable_files(tmp_path, size):
    _png(tmp_path / "c0" / "a.png", 8, 8)
    (tmp_path / "c0" / "a.txt").write_text("a cat")
    with pytest.raises(ValueError, match="resolution must be a positive"):
        ClassFolderDataset(tmp_path, size)
    with pytest.raises(ValueError, match="height must be a positive"):
        CaptionedImageFolder(tmp_path, size, 8)
    with pytest.raises(ValueError, match="width must be a positive"):
        CaptionedVideoFolder(tmp_path, 5, 8, size)
