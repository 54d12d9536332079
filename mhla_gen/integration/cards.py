"""Model cards for the folders the project writes for sharing, and pushing such a folder to the Hub.

Folders that leave the machine: a training run's ``final/`` (a whole transformer, a stage-1 conversion, or
a LoRA + MHLA folder), the Wan converter's ``--out`` and a pipeline saved with
:func:`mhla_gen.pipelines.saving.save_pipeline`. Each carries ``README.md``: a ``huggingface_hub``
``ModelCard`` whose YAML metadata (``ModelCardData``: base_model, library_name ``diffusers``, tags, license,
pipeline_tag) is completed by diffusers' own ``populate_model_card``, and whose body says what the model is,
its MHLA settings, how it was trained, what the run measured, and how to load it (:class:`CardFacts`).

Nothing local leaves: cards and shared files name models by hub id or by folder name, never by an absolute
path (:func:`public_ref`; :func:`scrub_local_paths` removes the ``_name_or_path`` entries diffusers writes
into configs). The local records the project's input checks need (a stage-1 teacher, a LoRA's base:
resolved and fingerprinted, :func:`outputs.folders.input_record`) stay in the folder's marker, which, like
all of the project's dot-file bookkeeping, :func:`push_to_hub` never uploads (:data:`LOCAL_ONLY`).

diffusers' ``load_or_create_model_card`` is not used: it first looks the card up with ``ModelCard.load``,
a Hub request for anything that is not a local file, and its template's body is TODO placeholders. The card
here is built from the same ``ModelCardData`` directly.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from huggingface_hub import ModelCard, ModelCardData

from ..errors import ConfigError
from ..outputs.folders import listed, read_marker, record_files
from ..processors.config import MHLAConfig

logger = logging.getLogger(__name__)

CARD = "README.md"
TAGS = ("mhla", "mhla_gen", "linear-attention")  # plus the base family's name
LOCAL_ONLY = (".*", "*/.*")  # never pushed: markers, listings, locks, temporary files (ignore patterns)
PAPER = "[MHLA (Multi-Head Linear Attention, arXiv 2601.07832)](https://arxiv.org/abs/2601.07832)"
# folder names that say little alone: shown with their parent's
_GENERIC = {"final", "transformer", "transformer_2", "train", "val", "validation", "test", "data", "images",
            "videos", "out", "output", "model", "pipeline"}


class PublicRef(NamedTuple):
    """How a model is named where it is shared: ``name`` a hub id (``hub``) or a local folder's name."""

    name: str
    hub: bool


def public_ref(ref: str | os.PathLike | None, override: str | None = None) -> PublicRef | None:
    """The shareable name of a model reference: ``override`` (a hub id the user gave), a hub id as given,
    the ``owner/name`` of a Hugging Face cache snapshot, else the local folder's name (with its parent's
    when the name alone says little, e.g. ``digits_softmax/final``). Never an absolute path."""
    if override:
        return PublicRef(str(override), True)
    if ref is None or str(ref) == "":
        return None
    text = str(ref)
    path = Path(text).expanduser()
    if not (path.exists() or path.is_absolute() or text.startswith((".", "~"))):
        return PublicRef(text, True)
    path = path.resolve()
    for part in path.parts:  # ~/.cache/huggingface/hub/models--owner--name/snapshots/<revision>
        if part.startswith("models--") and part.count("--") >= 2:
            return PublicRef("/".join(part.removeprefix("models--").split("--", 1)), True)
    generic = path.name in _GENERIC and path.parent != path
    name = f"{path.parent.name}/{path.name}" if generic else path.name
    return PublicRef(name or "model", False)


def base_license(ref) -> str | None:
    """The license a local copy of a model declares in its own model card (None: none, or a hub id)."""
    path = Path(str(ref)).expanduser() / CARD if ref else None
    if path is None or not path.is_file():
        return None
    try:
        return ModelCard.load(path).data.license
    except Exception:  # noqa: BLE001 - an unreadable card just says nothing about the license
        return None


def pipeline_tag(base) -> str:
    """The Hub task of a base family (class-conditional DiT has no task of its own on the Hub)."""
    if base.class_conditional:
        return "unconditional-image-generation"
    if base.image_conditioned:
        return "image-to-video"
    return "text-to-video" if base.video else "text-to-image"


# --------------------------------------------------------------------------------------------- the card
@dataclass
class CardFacts:
    """What a card says, every text already free of local paths.

    Attributes:
        title: the heading.
        summary: what the folder holds, one or two sentences.
        base: the base family record (:mod:`mhla_gen.bases`): tags, pipeline tag.
        base_model: the model it starts from (YAML ``base_model`` when it is a hub id).
        license: the license, when known.
        mhla: ``(component, MHLA config or None)`` per transformer in the folder.
        training: setting -> value rows (runs).
        metrics: ``(name, value, step)`` rows (runs).
        usage: the Python that loads (and samples) it.
        notes: extra lines under the usage.
    """

    title: str
    summary: str
    base: object = None
    base_model: PublicRef | None = None
    license: str | None = None
    mhla: list[tuple[str, MHLAConfig | None]] = field(default_factory=list)
    training: dict[str, str] = field(default_factory=dict)
    metrics: list[tuple[str, float, int | None]] = field(default_factory=list)
    usage: Snippet = field(default_factory=lambda: Snippet())
    notes: list[str] = field(default_factory=list)


def model_card(facts: CardFacts) -> ModelCard:
    """The ``ModelCard`` of ``facts``: metadata through ``ModelCardData`` and diffusers'
    ``populate_model_card`` (library name, tags), the body from :func:`card_body`."""
    from diffusers.utils.hub_utils import populate_model_card

    base_model = facts.base_model.name if facts.base_model and facts.base_model.hub else None
    data = ModelCardData(license=facts.license, base_model=base_model,
                         pipeline_tag=pipeline_tag(facts.base) if facts.base else None)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{card_body(facts)}")
    family = [facts.base.name] if facts.base else []
    return populate_model_card(card, tags=[*TAGS, *family])


def _table(rows: dict[str, str]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows.items())]


def mhla_rows(cfg: MHLAConfig | None, rope: bool = False) -> dict[str, str]:
    """The MHLA settings a reader needs, as table rows (the base's own attention when there is none);
    ``rope``: a base whose MHLA options include Wan's RoPE placement and head norm."""
    if cfg is None:
        return {"attention": "the base's own (no MHLA)"}
    extras = [f"CPE kernel {cfg.cpe_kernel}"] if cfg.cpe_kernel else []
    extras += [f"{cfg.gate_activation} output gate"] if cfg.gate else []
    extras += [f"RoPE {cfg.wan_rope}"] + (["per-head RMS norm"] if cfg.wan_head_norm else []) if rope else []
    return {
        "blocks": f"{' × '.join(map(str, cfg.blocks))} ({_product(cfg.blocks)} blocks)",
        "layers": "all self-attention layers" if cfg.layers is None else
        f"{list(cfg.layers)} (the others keep the base's attention)",
        "feature map": cfg.feature_map,
        "normalize": f"{cfg.normalize} (eps {cfg.eps:g})",
        "mixing": f"{cfg.mixing_init} init, {cfg.mixing_normalize}-normalised, "
        f"{'learned' if cfg.mixing_learnable else 'frozen'}",
        "extras": ", ".join(extras) if extras else "none",
    }


def _product(values) -> int:
    total = 1
    for v in values:
        total *= v
    return total


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def card_body(facts: CardFacts) -> str:
    """The Markdown under the metadata: summary, MHLA, training, metrics, usage."""
    lines = [f"# {facts.title}", "", facts.summary, "", f"Attention: {PAPER}, from the `mhla_gen` library.",
             ""]
    for component, cfg in facts.mhla:
        lines += [f"## MHLA settings ({component})" if len(facts.mhla) > 1 else "## MHLA settings", "",
                  *_table(mhla_rows(cfg, rope=bool(facts.base and "wan_rope" in facts.base.grid.rope))), ""]
    if facts.training:
        lines += ["## Training", "", *_table(facts.training), ""]
    if facts.metrics:
        lines += ["## Measured by the run", "", "| metric | value | step |", "|---|---|---|",
                  *(f"| {name} | {_number(v)} | {'' if step is None else step} |" for name, v, step in
                    facts.metrics), ""]
    lines += ["## How to use", "", "```bash", "pip install mhla_gen", "```", "", "```python",
              *facts.usage.lines(), "```", ""]
    lines += [*facts.notes, ""] if facts.notes else []
    return "\n".join(lines)


@dataclass
class Snippet:
    """The card's Python: imports (each once, in order) above the code that uses them."""

    imports: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)

    def add(self, imports: list[str], body: list[str]) -> Snippet:
        self.imports += [line for line in imports if line not in self.imports]
        self.body += body
        return self

    def lines(self) -> list[str]:
        return [*self.imports, "", *self.body]


def load_folder(snippet: Snippet, repo_id: str | None, name: str) -> Snippet:
    """``import mhla_gen`` and the line that sets ``folder``: a download of ``repo_id``, or this folder."""
    if repo_id:
        return snippet.add(["import mhla_gen", "from huggingface_hub import snapshot_download"],
                           [f'folder = snapshot_download("{repo_id}")  # or the path of a local copy'])
    return snippet.add(["import mhla_gen"],
                       [f'folder = "{name}"  # the path of this folder, or snapshot_download(REPO_ID)'])


def base_line(base_model: PublicRef | None, what: str) -> str:
    """The snippet line that sets ``base``: the model's hub id or local folder name."""
    name = base_model.name if base_model else "BASE_MODEL"
    where = "" if base_model and base_model.hub else " (a local folder: give its path)"
    return f'base = "{name}"  # {what}{where}'


# ------------------------------------------------------------------------------------------ writing
def write_card(folder: str | os.PathLike, card: ModelCard) -> Path | None:
    """Write ``card`` as ``folder/README.md`` (a folder of ours) through a temporary file listed first, and
    list it; a README.md the folder's listing does not name (a user's) is left alone (warning; None)."""
    folder = Path(folder)
    path, tmp = folder / CARD, folder / f".{CARD}.tmp"
    names = listed(folder) or {}
    if path.exists() and (CARD not in names or names[CARD] not in (None, path.stat().st_size)):
        logger.warning("%s holds a README.md mhla_gen did not write; left as it is (no model card written)",
                       folder)
        return None
    marked = read_marker(folder) is not None
    if marked:
        record_files(folder, tmp.name, pending=True)  # a killed write leaves a file its listing names
    tmp.write_text(str(card))
    os.replace(tmp, path)
    if marked:
        record_files(folder, CARD)
    return path


def scrub_local_paths(folder: str | os.PathLike) -> list[str]:
    """Drop the ``_name_or_path`` entries that name local folders from the diffusers configs under
    ``folder`` (``save_pretrained`` records where a model was loaded from, absolute); hub ids stay.
    Returns the files changed (relative)."""
    folder = Path(folder)
    changed = []
    for path in sorted(folder.rglob("*.json")):
        rel = path.relative_to(folder).as_posix()
        if any(part.startswith(".") for part in Path(rel).parts):
            continue
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        value = config.get("_name_or_path") if isinstance(config, dict) else None
        if value is None or public_ref(value) == PublicRef(str(value), True):
            continue
        del config["_name_or_path"]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # diffusers' own layout
        changed.append(rel)
    return changed


# ------------------------------------------------------------------------------------------ sharing
_ABSOLUTE = re.compile(r"(?<![\w.:/\\~-])/[\w.+-]+/[\w.+/-]*")  # /x/... not inside a URL or a word
_TEXT = (".md", ".json", ".jsonl", ".txt", ".yaml", ".yml")


def shared_files(folder: str | os.PathLike) -> list[str]:
    """The files :func:`push_to_hub` uploads (relative posix paths): everything but :data:`LOCAL_ONLY`."""
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(folder)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return list(filter_repo_objects(files, ignore_patterns=list(LOCAL_ONLY)))


def local_paths(folder: str | os.PathLike) -> list[str]:
    """``file: path`` for every absolute path in a shared text file or safetensors metadata of ``folder``
    (empty when it can be shared)."""
    from safetensors import safe_open

    folder = Path(folder)
    found = []
    for rel in shared_files(folder):
        path = folder / rel
        if path.suffix in _TEXT:
            text = path.read_text(errors="replace")
        elif path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                text = json.dumps(f.metadata() or {})
        else:
            continue
        found += [f"{rel}: {m}" for m in _ABSOLUTE.findall(text)]
    return found


def check_repo_id(repo_id: str | None, setting: str) -> None:
    """At start-up: ``repo_id`` (when given) is a Hub repo id, not a local path (ConfigError): a card names
    it as given (YAML ``base_model``, the loading snippet), so a path would leave the machine in it."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        if repo_id is not None:
            validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ConfigError(f"{setting}={repo_id!r} is not a Hub repo id (owner/name): {err}") from None


def check_push_target(repo_id: str | None, setting: str) -> None:
    """At start-up: ``repo_id`` is a valid hub repo id and a token is there to push with (ConfigError)."""
    if not repo_id:
        return
    import huggingface_hub

    check_repo_id(repo_id, setting)
    if huggingface_hub.get_token() is None:
        raise ConfigError(f"{setting}={repo_id!r} needs a Hugging Face token: `hf auth login`, or HF_TOKEN "
                          f"in the environment")


def push_to_hub(folder: str | os.PathLike, repo_id: str, token: str | None = None,
                private: bool | None = None, commit_message: str | None = None):
    """Upload ``folder`` (its :func:`shared_files`: never the project's local records) to the model repo
    ``repo_id`` with ``huggingface_hub.upload_folder``, creating the repo if needed; returns the commit.

    Raises:
        ValueError: the folder has no model card, or a shared file names an absolute local path.
    """
    import huggingface_hub

    folder = Path(folder)
    if not (folder / CARD).is_file():
        raise ValueError(f"{folder} has no {CARD} model card: write one (mhla_gen.integration.cards) "
                         "before pushing")
    leaks = local_paths(folder)
    if leaks:
        raise ValueError(f"{folder} names local paths in files it would share: {', '.join(leaks[:5])}")
    huggingface_hub.create_repo(repo_id, token=token, private=private, exist_ok=True)
    commit = huggingface_hub.upload_folder(repo_id=repo_id, folder_path=str(folder), token=token,
                                           ignore_patterns=list(LOCAL_ONLY),
                                           commit_message=commit_message or "Upload from mhla_gen")
    logger.info("pushed %s to the Hub as %s", folder, repo_id)
    return commit
