"""Data-side features of captioned training data: aspect-ratio bucket sizes and the bucket batch sampler,
which frames of a video an item holds, ``.json`` captions (beside files and in shards), gzip-compressed
tar shards."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from mhla_gen.data.buckets import BucketBatchSampler, auto_buckets, check_buckets, nearest_bucket
from mhla_gen.errors import ConfigError


# ----------------------------------------------------------------------------------------- buckets
def test_bucket_settings_auto_sizes_and_nearest_bucket():
    assert check_buckets(None) is None and check_buckets("auto") == "auto"
    assert check_buckets([[32, 64], [32, 64], (64, 32)]) == [[32, 64], [64, 32]]
    for bad in ([[32]], [[0, 32]], "square", [[32.5, 32]], []):
        with pytest.raises(ValueError, match="data.buckets must be null, auto or a list of"):
            check_buckets(bad)
    sizes = auto_buckets(512, 512, 32)
    assert (512, 512) in sizes and (384, 672) in sizes and (672, 384) in sizes
    assert all(h % 32 == 0 and w % 32 == 0 and h * w <= 512 * 512 and 0.5 <= h / w <= 2 for h, w in sizes)
    buckets = [(32, 32), (32, 64), (64, 32)]
    assert nearest_bucket(100, 48, buckets) == (32, 64)  # wide image -> wide bucket
    assert nearest_bucket(30, 70, buckets) == (64, 32) and nearest_bucket(50, 52, buckets) == (32, 32)


KEYS = ["a"] * 7 + ["b"] * 4 + ["c"] * 5  # 16 items in 3 buckets


def test_bucket_sampler_batches_one_bucket_in_a_seeded_order():
    sampler = BucketBatchSampler(KEYS, batch_size=2, processes=1, seed=3)
    epoch0 = list(sampler)
    assert len(epoch0) == len(sampler) == 3 + 2 + 2  # each bucket's remainder left out
    assert sampler.left_out() == {"a": 1, "c": 1}
    assert all(len({KEYS[i] for i in batch}) == 1 and len(batch) == 2 for batch in epoch0)
    assert len({i for batch in epoch0 for i in batch}) == 14  # no item twice
    assert list(BucketBatchSampler(KEYS, 2, 1, seed=3)) == epoch0  # a function of the seed...
    sampler.set_epoch(1)
    assert list(sampler) != epoch0  # ...and of the epoch
    sampler.set_epoch(0)
    assert list(sampler) == epoch0
    assert list(BucketBatchSampler(KEYS, 2, 1, seed=4)) != epoch0



# ------------------------------------------------------------------------------ frames, captions, shards
def _counting_mp4(path, frames: int = 12):
    """Frame i is a flat grey of level 20 i (lossy codecs keep flat frames' means)."""
    import imageio.v3 as iio

    video = np.stack([np.full((16, 16, 3), 20 * i, dtype=np.uint8) for i in range(frames)])
    iio.imwrite(path, video, fps=8, codec="libx264", plugin="pyav")
    return path


def _levels(frames) -> list[int]:
    return [round(float(np.asarray(f).mean()) / 20) for f in frames]


def test_frame_sampling_first_stride_uniform_random(tmp_path):
    from mhla_gen.data.videos import FrameSampling, frame_indices, read_frames

    video = _counting_mp4(tmp_path / "v.mp4")
    assert _levels(read_frames(video, 5)) == [0, 1, 2, 3, 4]
    from mhla_gen.data import CaptionedVideoFolder

    (tmp_path / "v.txt").write_text("grey")
    pixels = CaptionedVideoFolder(tmp_path, 5, 16, 16, frames=FrameSampling("uniform")).load(0)["pixels"]
    assert [round(float((f.mean() + 1) * 127.5 / 20)) for f in pixels.unbind(1)] == [0, 3, 6, 8, 11]
    assert _levels(read_frames(video, 5, FrameSampling("first", 2))) == [0, 2, 4, 6, 8]
    assert _levels(read_frames(video, 5, FrameSampling("uniform"))) == [0, 3, 6, 8, 11]
    random = read_frames(video, 5, FrameSampling("random", 2, seed=0), key="v")
    assert _levels(random) == frame_indices(12, 5, FrameSampling("random", 2, seed=0), "v")
    starts = {frame_indices(12, 5, FrameSampling("random", 2, seed=s), "v")[0] for s in range(20)}
    assert starts == {0, 1, 2, 3}  # every start that fits 9 frames in 12, none beyond
    assert frame_indices(12, 5, FrameSampling("random", 1, 7), "v") == frame_indices(12, 5, FrameSampling(
        "random", 1, 7), "v")
    with io.BytesIO(video.read_bytes()) as data:  # a tar member's or dataset cell's bytes: read twice
        assert _levels(read_frames(data, 5, FrameSampling("uniform"))) == [0, 3, 6, 8, 11]
    with pytest.raises(ValueError, match="has fewer than the 13 frames"):
        read_frames(video, 7, FrameSampling("first", 2))
    with pytest.raises(ValueError, match="the clip has 12 frames, need 13"):
        read_frames(video, 7, FrameSampling("random", 2))


def test_json_captions_beside_files_and_in_shards(tmp_path):
    from mhla_gen.data import CaptionedImageFolder
    from mhla_gen.data.shards import TarShardDataset

    folder = tmp_path / "images"
    folder.mkdir()
    for name in ("a", "b", "c", "d"):
        Image.new("RGB", (8, 8)).save(folder / f"{name}.png")
    (folder / "a.json").write_text(json.dumps({"text": "a red cat", "width": 8}))
    (folder / "b.json").write_text(json.dumps({"caption": ["a blue dog", "a dog"]}))
    (folder / "b.txt").write_text("the txt wins")
    (folder / "c.json").write_text(json.dumps({"url": "no caption here"}))  # left out
    ds = CaptionedImageFolder(folder, 8, 8)
    assert [ds.captions[p] for p in ds.paths] == ["a red cat", "the txt wins"]
    (folder / "d.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"d\.json: not JSON"):
        CaptionedImageFolder(folder, 8, 8)

    png = (folder / "a.png").read_bytes()
    _tar(tmp_path / "shards" / "s.tar", {"x.png": png, "x.json": b'{"caption": "from json"}',
                                         "y.png": png, "y.txt": b"from txt", "y.json": b'{"text": "no"}'})
    assert [item[4] for item in TarShardDataset(str(tmp_path / "shards"), 8, 8).index] == ["from json",
                                                                                            "from txt"]


def _tar(path, members: dict[str, bytes], mode: str = "w") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_gzip_shards_read_like_plain_ones_and_other_compressions_are_refused(tmp_path):
    from mhla_gen.data.shards import TarShardDataset

    rng = np.random.default_rng(0)
    members = {}
    for i in range(5):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (12, 20, 3), dtype=np.uint8)).save(buffer, format="PNG")
        members |= {f"{i:03d}.png": buffer.getvalue(), f"{i:03d}.txt": f"caption {i}".encode()}
    names = sorted(members)
    _tar(tmp_path / "plain" / "a.tar", {n: members[n] for n in names[:6]})
    _tar(tmp_path / "plain" / "b.tar", {n: members[n] for n in names[6:]})
    _tar(tmp_path / "gz" / "a.tar.gz", {n: members[n] for n in names[:6]}, "w:gz")
    _tar(tmp_path / "gz" / "b.tgz", {n: members[n] for n in names[6:]}, "w:gz")
    plain, gz = TarShardDataset(str(tmp_path / "plain"), 8, 8), TarShardDataset(str(tmp_path / "gz"), 8, 8)
    assert len(gz) == 5 and all(gz.gzipped.values())
    for i in [0, 1, 2, 4, 3, 0]:  # in order, then backwards (a rewind) and across shards
        a, b = plain.load(i), gz.load(i)
        assert a["caption"] == b["caption"] and torch.equal(a["pixels"], b["pixels"])
    _tar(tmp_path / "bz" / "a.tar", members, "w:bz2")
    with pytest.raises(ConfigError, match=r"a\.tar is not a readable tar shard .* gzip-compressed .tar.gz"):
        TarShardDataset(str(tmp_path / "bz"), 8, 8)


