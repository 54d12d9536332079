"""Training items from a Hugging Face ``datasets`` dataset (``data.source=hf``), as diffusers' training
examples take them: captioned images or videos (SANA, Wan) and class-labelled images (DiT).

``data.path`` is a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read with
``load_from_disk``), or anything ``load_dataset`` reads: a local folder (images or videos +
``metadata.jsonl``, the imagefolder / videofolder layout; parquet / arrow / json files) or a hub name, with
``data.split`` (a saved ``DatasetDict``: one of its splits; a single saved ``Dataset``: the split it
records, ``train`` when it records none; another ``data.split`` is refused). Columns are named by
``data.image_column`` / ``data.video_column`` / ``data.caption_column`` / ``data.label_column``; each is
checked at start-up (present, dataset non-empty), and an undecodable item is skipped with a warning like a
bad file in a folder. Image and video columns are read undecoded (bytes or a path) and decoded here with
PIL / PyAV, so no extra decoder package is needed. ``load_dataset`` keeps its Arrow cache in
``HF_DATASETS_CACHE`` (never inside ``data.path``). A caption column holding a list of captions uses the
first (the feature cache encodes one caption per item).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
from PIL import Image

from ..errors import ConfigError
from .images import _SkippingDataset, center_crop_arr, check_size, resize_center_crop, to_tensor
from .videos import FrameSampling, frames_to_tensor, read_frames


def load_hf_dataset(source: str, split: str, setting: str = "data.path"):
    """The ``split`` of ``source`` as a ``datasets.Dataset`` (see the module docstring); ConfigError naming
    ``setting`` when it cannot be loaded, the split does not exist or the dataset is empty."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data.source=hf needs the datasets package (pip install datasets); {setting}="
                          f"{source!r}") from None
    path = Path(source).expanduser()
    saved = (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    try:
        if saved:
            dataset = datasets.load_from_disk(str(path))
        else:
            dataset = datasets.load_dataset(str(path) if path.exists() else source, split=split)
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds; all mean "cannot be read"
        raise ConfigError(f"{setting}={source!r} cannot be loaded as a datasets dataset "
                          f"({type(err).__name__}: {err})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ConfigError(f"data.split={split!r} is not a split of {setting}={source!r}: {list(dataset)}")
        dataset = dataset[split]
    elif saved:
        check_saved_split(dataset, split, f"{setting}={source!r}")
    if len(dataset) == 0:
        raise ConfigError(f"{setting}={source!r} (split {split!r}) holds no items")
    return dataset


def check_saved_split(dataset, split: str, where: str) -> None:
    """One ``Dataset`` saved with ``save_to_disk`` holds one split, the one it records (``dataset.split``;
    None when it was built in memory, taken as ``train``): ``data.split`` must name it, else ConfigError."""
    holds = str(dataset.split) if dataset.split is not None else None
    if split != (holds or "train"):
        what = f"the {holds!r} split" if holds else "one unnamed split (read as 'train')"
        fix = f"set data.split={holds}" if holds else "leave data.split at train"
        raise ConfigError(f"data.split={split!r}, but {where} is one saved Dataset holding {what}, not a "
                          f"DatasetDict with named splits: {fix}, or save a DatasetDict")


def check_columns(dataset, columns: dict[str, str], source: str) -> None:
    """Every ``{setting: column}`` names a column of ``dataset``; ConfigError listing the columns."""
    for setting, column in columns.items():
        if column not in dataset.column_names:
            raise ConfigError(f"{setting}={column!r} is not a column of data.path={source!r}; its columns: "
                              f"{dataset.column_names}")


def undecoded(dataset, column: str):
    """``dataset`` with an ``Image`` / ``Video`` feature ``column`` left as ``{"bytes", "path"}``."""
    import datasets

    feature = dataset.features[column]
    for kind in ("Image", "Video"):
        cls = getattr(datasets, kind, None)
        if cls is not None and isinstance(feature, cls):
            return dataset.cast_column(column, cls(decode=False))
    return dataset


def media_source(value):
    """A dataset cell holding an image / video -> what PIL / PyAV open: a file object or a path."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return io.BytesIO(value["bytes"])
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return io.BytesIO(value)
    if isinstance(value, (str, Path)) and value:
        return value
    raise ValueError(f"not an image or video cell: {type(value).__name__}")


def caption_of(value) -> str:
    """A caption cell: a string, or a list of captions (the first is used)."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    if not isinstance(value, str):
        raise ValueError(f"caption is not text: {value!r}")
    return value


class _HFDataset(_SkippingDataset):
    """Rows of a ``datasets`` dataset with one media column (undecoded). ``paths`` are row ids with the
    dataset's fingerprint (what the feature cache is keyed by)."""

    def __init__(self, source: str, split: str, columns: dict[str, str], media_setting: str, buckets=None):
        super().__init__(buckets)
        dataset = load_hf_dataset(source, split)
        check_columns(dataset, columns, source)
        self.media = columns[media_setting]
        self.dataset = undecoded(dataset, self.media)
        fingerprint = getattr(dataset, "_fingerprint", "")
        self.paths = [f"{source}[{split}]#{i}@{fingerprint}" for i in range(len(dataset))]

    def row(self, index: int) -> dict:
        return self.dataset[index]


class HFCaptionedImages(_HFDataset):
    """Items: ``{"pixels": (3, H, W) in [-1, 1], "caption": str}`` (resize to cover, centre crop; with
    ``buckets``: into the bucket nearest the image's aspect ratio)."""

    def __init__(self, source: str, split: str, image_column: str, caption_column: str, height: int,
                 width: int, buckets=None):
        check_size("height", height)
        check_size("width", width)
        columns = {"data.image_column": image_column, "data.caption_column": caption_column}
        super().__init__(source, split, columns, "data.image_column", buckets)
        self.caption, self.height, self.width = caption_column, height, width

    def load(self, index: int) -> dict:
        row = self.row(index)
        with Image.open(media_source(row[self.media])) as img:
            image = resize_center_crop(img.convert("RGB"), *self.size_for(*img.size))
        return {"pixels": to_tensor(image), "caption": caption_of(row[self.caption])}


class HFCaptionedVideos(_HFDataset):
    """Items: ``{"pixels": (3, F, H, W) in [-1, 1], "caption": str}``: ``num_frames`` frames chosen by
    ``frames`` (default: the first ones); ``buckets`` as for images."""

    def __init__(self, source: str, split: str, video_column: str, caption_column: str, num_frames: int,
                 height: int, width: int, frames: FrameSampling | None = None, buckets=None):
        check_size("height", height)
        check_size("width", width)
        columns = {"data.video_column": video_column, "data.caption_column": caption_column}
        super().__init__(source, split, columns, "data.video_column", buckets)
        self.caption, self.num_frames, self.height, self.width = caption_column, num_frames, height, width
        self.frames = frames or FrameSampling()

    def load(self, index: int) -> dict:
        row = self.row(index)
        source = media_source(row[self.media])
        frames = read_frames(source, self.num_frames, self.frames, key=self.paths[index])
        return {"pixels": frames_to_tensor(frames, *self.size_for(*frames[0].size)),
                "caption": caption_of(row[self.caption])}


class HFClassImages(_HFDataset):
    """Class-labelled images (DiT). Items: ``{"pixels": (3, R, R) in [-1, 1], "class_labels": long}``
    (ADM / DiT centre crop). ``num_classes``: the label column's ``ClassLabel`` count, else max label + 1."""

    def __init__(self, source: str, split: str, image_column: str, label_column: str, resolution: int):
        check_size("resolution", resolution)
        columns = {"data.image_column": image_column, "data.label_column": label_column}
        super().__init__(source, split, columns, "data.image_column")
        labels = list(self.dataset[label_column])
        if not all(isinstance(x, int) and x >= 0 for x in labels):
            raise ConfigError(f"data.label_column={label_column!r} of data.path={source!r} must hold class "
                              f"ids >= 0 (integers)")
        names = getattr(self.dataset.features[label_column], "num_classes", None)
        self.labels = torch.tensor(labels)
        self.num_classes = int(names) if names else int(self.labels.max()) + 1
        self.resolution = resolution

    def load(self, index: int) -> dict:
        row = self.row(index)
        with Image.open(media_source(row[self.media])) as img:
            image = center_crop_arr(img.convert("RGB"), self.resolution)
        return {"pixels": to_tensor(image), "class_labels": self.labels[index]}
