"""Image conditions of an image-to-video base (record ``conditioning="captions+image"``): each sample is a
``(prompt, image)`` pair, from a prompts file or from prompts and images given side by side.

A prompts file of pairs is JSONL (``{"prompt": "...", "image": "cat.png"}`` per line) or CSV (a header row
naming ``prompt`` and ``image`` columns); a relative image path is relative to the file's folder. Every image
is opened and decoded at start-up (:func:`check_images`), so a missing or unreadable file stops the command
in one line naming the setting, before anything is written or any model is loaded.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from mhla_gen.errors import ConfigError

PAIR_SUFFIXES = (".jsonl", ".csv")


def pair_images(prompts: list[str], images: list[str], setting: str) -> list[tuple[str, str]]:
    """``(prompt, image)`` pairs: one image per prompt, or one image for every prompt (``setting``: the
    images' name in errors)."""
    if len(images) not in (1, len(prompts)):
        raise ConfigError(f"{setting}: {len(images)} images for {len(prompts)} prompts; give one image per "
                          f"prompt, or one image for all")
    return list(zip(prompts, images * len(prompts) if len(images) == 1 else images))


def _rows(path: Path, setting: str) -> list[dict]:
    text = path.read_text()
    if path.suffix.lower() == ".csv":
        return list(csv.DictReader(text.splitlines()))
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ConfigError(f"{setting}={str(path)!r} line {number} is not JSON: {err.msg}") from None
    return rows


def read_image_prompts(path: str | Path, setting: str) -> list[tuple[str, str]]:
    """``(prompt, absolute image path)`` of every row of a JSONL / CSV prompts file; ConfigError naming
    ``setting`` (and the row) for another format, a row without both fields, or no rows."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{setting}={str(path)!r} does not exist")
    if path.suffix.lower() not in PAIR_SUFFIXES:
        raise ConfigError(f"{setting}={str(path)!r}: an image-to-video base reads (prompt, image) pairs "
                          f"from a {' or '.join(PAIR_SUFFIXES)} file with 'prompt' and 'image' fields")
    pairs = []
    for number, row in enumerate(_rows(path, setting), 1):
        if not isinstance(row, dict) or not row.get("prompt") or not row.get("image"):
            raise ConfigError(f"{setting}={str(path)!r} row {number} needs a 'prompt' and an 'image'")
        image = Path(str(row["image"])).expanduser()
        pairs.append((str(row["prompt"]).strip(), str(image if image.is_absolute() else path.parent / image)))
    if not pairs:
        raise ConfigError(f"{setting}={str(path)!r} holds no (prompt, image) pairs")
    return pairs


def check_images(images: list[str], setting: str) -> None:
    """Every image exists and decodes (PIL); FileNotFoundError / ConfigError naming ``setting`` and file."""
    for image in dict.fromkeys(images):
        if not Path(image).expanduser().is_file():
            raise FileNotFoundError(f"{setting}: image {image!r} does not exist")
        try:
            with Image.open(Path(image).expanduser()) as opened:
                opened.load()
        except (UnidentifiedImageError, OSError) as err:
            raise ConfigError(f"{setting}: image {image!r} cannot be read as an image ({err})") from None


def open_image(image) -> Image.Image:
    """An RGB PIL image from a path or an image."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    with Image.open(Path(image).expanduser()) as opened:
        return opened.convert("RGB")
