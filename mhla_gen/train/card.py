"""The model card of a training run's ``final/`` (:mod:`mhla_gen.integration.cards`): what the run's config
and ``metrics.jsonl`` say, in words that name no local path.

:func:`write_run_card` is called twice by the loop: when ``final/`` is built (the metrics logged so far)
and after the end-of-run evaluation (its metrics too). ``share.base_model`` names the model the run starts
from by hub id where the config holds a local folder; ``share.license`` sets the license;
``share.push_to_hub`` is the repo the card's loading lines download.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import diffusers
from torch import nn

from ..bases import base_for_model
from ..integration.cards import (
    CardFacts,
    Snippet,
    base_license,
    base_line,
    load_folder,
    model_card,
    public_ref,
    write_card,
)
from ..integration.install import is_mhla_installed
from ..integration.lora import is_lora_folder
from .io import read_jsonl

OPERATIONAL = {"step", "loss", "lr", "grad_norm", "steps_per_s", "num_processes"}  # not results


def run_metrics(out: Path) -> list[tuple[str, float, int | None]]:
    """``(name, value, step)``: the last logged training loss, then the latest value of every other number
    the run recorded (end-of-run FID, stage-1 errors, validation losses, ...), from ``metrics.jsonl``."""
    path = out / "metrics.jsonl"
    records = read_jsonl(path) if path.is_file() else []
    latest: dict[str, tuple[float, int | None]] = {}
    for record in records:
        for key, value in record.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and (key == "loss" or key not in OPERATIONAL):
                latest[key] = (value, record.get("step"))
    rows = [("training loss (last logged)", *latest.pop("loss"))] if "loss" in latest else []
    return rows + [(key, value, step) for key, (value, step) in latest.items()]


def _starts_from(cfg) -> tuple[str | None, str]:
    """``(model reference, what it is)`` of the model a run starts from."""
    model = cfg.model
    if getattr(model, "pretrained", None):
        return model.pretrained, "the pipeline it was fine-tuned from (VAE, text encoder, scheduler)"
    return model.init_from, "the model it started from"


def training_rows(cfg, record: dict) -> dict[str, str]:
    """The run's settings a reader needs, every model and data folder by its public name."""
    tc, data, model = cfg.train, cfg.data, cfg.model
    rows = {}
    start, _ = _starts_from(cfg)
    if start:
        rows["starts from"] = f"`{public_ref(start, cfg.share.base_model).name}`"
    if getattr(model, "init_from", None) and getattr(model, "pretrained", None):
        rows["transformer from"] = f"`{public_ref(model.init_from).name}`"
    if record.get("teacher"):
        rows["converted from (teacher)"] = f"`{public_ref(record['teacher']).name}`"
    rows["attention trained"] = model.attention
    source = data.source
    drawn = source in ("digits", "shapes")  # built in: no path
    where = public_ref(data.path) if getattr(data, "path", None) and not drawn else None
    rows["data"] = source + (f" `{where.name}`" if where else "") + (
        f" (split {data.split})" if source == "hf" else "")
    if hasattr(data, "resolution"):
        rows["size"] = f"{data.resolution} × {data.resolution} px"
    else:
        rows["size"] = f"{data.height} × {data.width} px" + (
            f", {data.num_frames} frames" if record.get("video") else "")
    rows["steps"] = f"{tc.max_steps} optimizer steps, global batch {tc.global_batch_size}"
    optimizer = getattr(tc, "optimizer", "adamw")
    rows["optimizer"] = (f"{optimizer}, learning rate {tc.learning_rate:g} ({tc.lr_scheduler}, "
                         f"{tc.lr_warmup_steps} warm-up steps), weight decay {tc.weight_decay:g}")
    lora = f"LoRA rank {tc.lora_rank} (alpha {tc.lora_alpha:g}) + the MHLA parameters"
    trained = {"all": "every parameter", "mhla": "the MHLA parameters only", "lora": lora}
    rows["trained"] = trained.get(tc.trainable, tc.trainable)
    rows["precision"] = f"mixed precision {tc.mixed_precision}" if tc.mixed_precision != "no" else "float32"
    if tc.ema_decay > 0:
        rows["EMA"] = f"decay {tc.ema_decay:g} (these are the EMA weights)"
    if tc.distill.enabled:
        teacher = public_ref(tc.distill.teacher).name
        rows["distillation"] = (f"output × {tc.distill.output_weight:g}, attention × "
                                f"{tc.distill.attention_weight:g}, teacher `{teacher}`")
    transfer = getattr(cfg, "transfer", None)
    if transfer is not None:
        rows["stage 1"] = (f"attention transfer: trained {transfer.trainable}, end-to-end weight "
                           f"{transfer.output_weight:g}, softmax layers {cfg.hybrid.softmax_layers}")
    rows["seed"] = str(cfg.seed)
    return rows


LOAD = "transformer = mhla_gen.load_transformer(folder)  # MHLA installed, weights loaded"


def usage(cfg, base, folder: Path, repo_id: str | None, name: str) -> Snippet:
    """Python that loads the folder, then samples once with the run's own sampling settings."""
    snippet = load_folder(Snippet(), repo_id, name)
    if base.class_conditional:
        return _dit_sampling(snippet.add([], [LOAD]), cfg)
    start, what = _starts_from(cfg)
    pipeline, slot = base.pipeline_class, getattr(cfg.model, "expert", "transformer")
    base_model = public_ref(start, cfg.share.base_model)
    snippet.add([f"from diffusers import {pipeline}"], [base_line(base_model, what)])
    if is_lora_folder(folder):
        into = ", load_into_transformer_2=True" if slot == "transformer_2" else ""
        snippet.add(["from mhla_gen.integration.lora import load_lora_weights"],
                    [f"pipe = {pipeline}.from_pretrained(base)",
                     f"load_lora_weights(pipe, folder{into})  # installs MHLA, loads adapter + MHLA weights"])
    else:
        snippet.add([], [LOAD, f"pipe = {pipeline}.from_pretrained(base, {slot}=transformer)"])
    return _flow_sampling(snippet, cfg, base)


def _dit_sampling(snippet: Snippet, cfg) -> Snippet:
    """DiTPipeline around the transformer: the run's VAE (or none, in pixel space) and sampler."""
    d, data = cfg.diffusion, cfg.data
    samplers = {"ddim": "DDIMScheduler", "dpm": "DPMSolverMultistepScheduler", "ddpm": "DDPMScheduler"}
    sampler = samplers[d.sampler]
    clip = ", clip_sample=False" if d.sampler in ("ddim", "ddpm") else ""
    if data.vae is None or data.source in ("digits", "shapes"):
        snippet.add(["from mhla_gen.train.dit_model import identity_vae"],
                    ["vae = identity_vae()  # pixel space"])
    else:
        sub = f', subfolder="{data.vae_subfolder}"' if data.vae_subfolder else ""
        vae = public_ref(data.vae).name
        snippet.add(["from diffusers import AutoencoderKL"],
                    [f'vae = AutoencoderKL.from_pretrained("{vae}"{sub})  # the VAE of the training data'])
    classes = list(range(min(3, cfg.model.num_classes)))
    return snippet.add([f"from diffusers import DiTPipeline, {sampler}"], [
        f"scheduler = {sampler}.from_config(dict(num_train_timesteps={d.num_train_timesteps}, "
        f'beta_schedule="{d.beta_schedule}", beta_start={d.beta_start}, beta_end={d.beta_end}{clip}))',
        "pipe = DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler)",
        f"images = pipe(class_labels={classes}, num_inference_steps={cfg.log.sample_steps}, "
        f"guidance_scale={cfg.log.guidance_scale}).images",
    ])


def _flow_sampling(snippet: Snippet, cfg, base) -> Snippet:
    """One sample with the run's size, text length and sampling settings (the way its sample grids ran)."""
    d, log = cfg.data, cfg.log
    prompt = d.sample_prompts[0].replace('"', "'")
    size = f"height={d.height}, width={d.width}"
    common = f"num_inference_steps={log.sample_steps}, guidance_scale={log.guidance_scale}, " \
             f"max_sequence_length={d.max_sequence_length}"
    takes = inspect.signature(getattr(diffusers, base.pipeline_class).__call__).parameters
    # SANA's pipelines: the exact size, and the captions as the run encoded them
    extra = "use_resolution_binning=False, complex_human_instruction=None, " if "complex_human_instruction" \
        in takes else ""
    if not base.video:
        return snippet.add([], [f'image = pipe(prompt="{prompt}", {size}, {extra}{common}).images[0]'])
    frames = "num_frames" if "num_frames" in takes else "frames"
    image = ""
    if base.image_conditioned:
        snippet.add(["from diffusers.utils import load_image"],
                    ['first_frame = load_image("first_frame.png")  # the video starts from this image'])
        image = "image=first_frame, "
    call = f'pipe({image}prompt="{prompt}", {size}, {frames}={d.num_frames}, {extra}{common})'
    return snippet.add([], [f"video = {call}.frames[0]"])


def write_run_card(task, model: nn.Module, folder: Path) -> Path | None:
    """The card of a run's ``final/`` (being built in ``folder``, or in place), from the resolved config,
    the folder's record and the run's ``metrics.jsonl``."""
    cfg = task.run_config()
    base = base_for_model(model)
    record = {**task.model_record(), "video": base.video}
    out = Path(cfg.output_dir)
    start, _ = _starts_from(cfg)
    lora = is_lora_folder(folder)
    kind = "a LoRA adapter plus MHLA parameters" if lora else "a transformer"
    how = "converted by attention transfer (stage 1 of the converter)" if record.get("stage") else "trained"
    mhla = model.mhla_config if is_mhla_installed(model) else None
    summary = (f"{kind[0].upper()}{kind[1:]} for {base.pipeline_class} ({base.name}) with MHLA "
               f"self-attention, {how} with mhla_gen (run `{out.name}`).")
    if lora:
        summary += " The base weights are not in this folder: they load from the base model named below."
    facts = CardFacts(
        title=f"{out.name}: {base.name} with MHLA", summary=summary, base=base,
        base_model=public_ref(start, cfg.share.base_model),
        license=cfg.share.license or base_license(start), mhla=[(getattr(cfg.model, "expert", "transformer"),
                                                                 mhla)],
        training=training_rows(cfg, record), metrics=run_metrics(out),
        usage=usage(cfg, base, folder, cfg.share.push_to_hub, f"{out.name}/final"),
    )
    return write_card(folder, model_card(facts))
