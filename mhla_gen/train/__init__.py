"""Training: config dataclasses + strict loading, the shared Accelerate loop, objectives, per-model tasks.

cfg = load_config(DiTRunConfig, "configs/dit_digits.yaml", ["train.max_steps=100"])
train(cfg, DiTTask(cfg))          # scripts/train_dit.py; SanaTask / WanTask for the fine-tuning scripts
"""

from .config import DiTRunConfig, RunConfig, SanaRunConfig, WanRunConfig, load_config
from .loop import train
from .task import TrainTask

__all__ = ["DiTRunConfig", "RunConfig", "SanaRunConfig", "TrainTask", "WanRunConfig", "load_config", "train"]
