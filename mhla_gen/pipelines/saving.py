"""A pipeline whose transformer runs MHLA, saved as a folder to share: diffusers' ``save_pretrained`` under
the project's file rules (:mod:`mhla_gen.outputs.folders`), with a model card
(:mod:`mhla_gen.integration.cards`).

    pipe = load_sana_pipeline(BASE, transformer_path="runs/sana/final")
    save_pipeline(pipe, "exports/sana-mhla", base_model="Efficient-Large-Model/Sana_600M_512px_diffusers")
    save_pipeline(pipe, "exports/sana-mhla", push_to_hub="me/sana-mhla")     # and upload it

The folder loads with diffusers' own ``DiffusionPipeline.from_pretrained(folder)`` after ``import mhla_gen``.
"""

from __future__ import annotations

from pathlib import Path

from mhla_gen.bases import base_for_model
from mhla_gen.integration import cards
from mhla_gen.integration.cards import (
    CardFacts,
    Snippet,
    base_license,
    load_folder,
    model_card,
    public_ref,
    scrub_local_paths,
    write_card,
)
from mhla_gen.integration.install import is_mhla_installed
from mhla_gen.outputs.folders import (
    check_apart,
    check_replaceable,
    check_temp,
    fresh_temp,
    replace_with,
    write_marker,
)

KIND = "pipeline"  # the kind of folder it writes (mhla_gen.outputs.folders.KINDS)
EXPERTS = ("transformer", "transformer_2")


def _sources(pipe) -> dict[str, str]:
    """Where the pipeline and its components were loaded from (setting-like name -> path or hub id)."""
    found = {"the pipeline's source": pipe.name_or_path}
    for name, component in pipe.components.items():
        config = getattr(component, "config", None)
        source = config.get("_name_or_path") if hasattr(config, "get") else None
        found[f"its {name}'s source"] = source
    return {k: str(v) for k, v in found.items() if v}


def save_pipeline(pipe, folder, base_model: str | None = None, license: str | None = None,
                  push_to_hub: str | None = None, token: str | None = None) -> Path:
    """Save ``pipe`` into ``folder`` with a model card and no local path in its configs; returns the folder.

    Args:
        pipe: a diffusers pipeline, e.g. from ``load_sana_pipeline(..., transformer_path=final)``.
        folder: new, empty, or a pipeline folder this function wrote (then replaced whole when complete).
        base_model: the hub id of the pipeline it comes from (default: what it was loaded from: its hub
            id, or a local folder's name).
        license: the card's license (default: the one a local source's own card declares).
        push_to_hub: a Hub repo id to upload the folder to once written (``huggingface_hub``).
        token: the Hub token for the upload (default: the stored one).
    Raises:
        ConfigError: ``folder`` is not new, empty or ours; it is, holds or lies inside one of the
            pipeline's sources; or the repo id or token is missing. Checked before anything is written.
    """
    folder = Path(folder).expanduser()
    cards.check_push_target(push_to_hub, "push_to_hub")
    cards.check_repo_id(base_model, "base_model")
    check_apart(folder, "folder", _sources(pipe))
    check_replaceable(folder, KIND, "folder")
    check_temp(folder, KIND, "folder")
    tmp = fresh_temp(folder, KIND, "folder")
    pipe.save_pretrained(tmp)
    scrub_local_paths(tmp)
    write_card(tmp, model_card(pipeline_facts(pipe, folder, base_model, license, push_to_hub)))
    write_marker(tmp, KIND)
    replace_with(tmp, folder, KIND, "folder")
    if push_to_hub:
        cards.push_to_hub(folder, push_to_hub, token=token)
    return folder


def pipeline_facts(pipe, folder: Path, base_model: str | None, license: str | None,
                   repo_id: str | None) -> CardFacts:
    """What the card of a saved pipeline says: family, MHLA of each transformer, how to load it."""
    transformers = [(name, getattr(pipe, name, None)) for name in EXPERTS]
    transformers = [(name, t) for name, t in transformers if t is not None]
    base = base_for_model(transformers[0][1])
    source = pipe.name_or_path
    snippet = load_folder(Snippet(), repo_id, folder.name).add(
        ["from diffusers import DiffusionPipeline"],
        [f"pipe = DiffusionPipeline.from_pretrained(folder)  # a {type(pipe).__name__}, MHLA included"])
    return CardFacts(
        title=f"{folder.name}: {type(pipe).__name__} with MHLA",
        summary=f"A {type(pipe).__name__} ({base.name}) whose transformer runs MHLA self-attention, saved "
                "with mhla_gen. Call it as the stock pipeline.",
        base=base, base_model=public_ref(source, base_model), license=license or base_license(source),
        mhla=[(name, t.mhla_config if is_mhla_installed(t) else None) for name, t in transformers],
        usage=snippet,
    )
