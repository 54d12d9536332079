"""scripts/train_dit.py, SIGKILLed at a chosen point of the run: what a preempted job gets (no cleanup).

    python tests/fault_injection.py kill_after_step=3 --config configs/tiny/dit.yaml output_dir=...
    python tests/fault_injection.py kill_during_checkpoint=4 --config configs/tiny/dit.yaml output_dir=...
    python tests/fault_injection.py kill_after_step=3 linearize --config ... output_dir=...

``kill_after_step=N``: right after optimizer step N, its metrics record and its checkpoint (if due).
``kill_during_checkpoint=N``: checkpoint N is completely written to its temporary folder and not yet
renamed into place (a torn save). The kill comes from a :class:`~mhla_gen.train.loop.TrainCallback`
passed to the training loop, so production code carries no test switch. Used by tests/test_train_dit.py.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from mhla_gen.commands.cli import linearize_main, run, train_main
from mhla_gen.train.task import Run, TrainCallback

REPO = Path(__file__).resolve().parents[1]


class SigkillAt(TrainCallback):
    """SIGKILL this process after step ``after_step`` or while saving checkpoint ``during_checkpoint``."""

    def __init__(self, after_step: int = 0, during_checkpoint: int = 0):
        self.after_step, self.during_checkpoint = after_step, during_checkpoint

    def on_step_end(self, run: Run) -> None:
        if run.step == self.after_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_checkpoint_staged(self, run: Run) -> None:
        if run.step == self.during_checkpoint:
            os.kill(os.getpid(), signal.SIGKILL)


def parse_kill(text: str) -> SigkillAt:
    """``kill_after_step=N`` or ``kill_during_checkpoint=N`` -> the callback."""
    name, _, step = text.partition("=")
    point = name.removeprefix("kill_")
    if point not in ("after_step", "during_checkpoint") or not step.isdigit():
        raise SystemExit(f"expected kill_after_step=N or kill_during_checkpoint=N, got {text!r}")
    return SigkillAt(**{point: int(step)})


def main(argv: list[str]) -> None:
    """scripts/train_dit.py's ``main`` (the same entry and default config) with the kill callback; with
    ``linearize`` after the kill point, scripts/linearize.py's."""
    kill, args = parse_kill(argv[0]), argv[1:]
    if args and args[0] == "linearize":
        linearize_main(args[1:], callbacks=[kill])
        return
    default_config = str(REPO / "mhla_gen" / "configs" / "dit_digits.yaml")
    train_main("dit", "train_dit.py with fault injection", default_config, args, callbacks=[kill])


if __name__ == "__main__":
    run(lambda: main(sys.argv[1:]))
