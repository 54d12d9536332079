"""The ``mhla-gen`` command (:func:`main`: ``mhla-gen NAME ARGS``, also ``python -m mhla_gen NAME ARGS``);
what every entry point does with a user's mistake: one line, exit status 2 (:func:`run`); and the command
line the training commands share (:func:`train_main`).

Settings and paths are checked at start-up, before anything is written, and raise
:class:`~mhla_gen.errors.ConfigError` (a ``ValueError``), ``FileNotFoundError`` or another ``OSError``
with a message naming the setting or path. A traceback through OmegaConf and the training loop adds
nothing to that message, so :func:`run` prints ``<program>: error: <message>`` on one line (as argparse
does for bad flags) and exits with 2. ``MHLA_GEN_TRACEBACK=1`` in the environment shows the traceback
instead. Called in-process (``main(argv)``, the tests), the exceptions propagate unchanged.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .. import __version__
from ..bases import BASES, base_for
from ..bases.dit import BASE as DEFAULT
from ..configs import resolve_config
from ..errors import ConfigError
from . import COMMANDS

if TYPE_CHECKING:  # the training stack is imported by the commands that train, not by every entry point
    from ..train.task import TrainCallback

# a user's mistake in settings, data or paths (ConfigError is a ValueError; FileNotFoundError,
# PermissionError, IsADirectoryError and a read-only file system are OSErrors)
EXPECTED_ERRORS = (ValueError, OSError)


def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line (multi-line lists joined with '; ')."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = "; ".join(lines) or type(err).__name__
    return text.replace(":;", ":")


def run(main: Callable[[], object]) -> None:
    """Call ``main()``; an expected error becomes a one-line message and exit status 2."""
    try:
        main()
    except EXPECTED_ERRORS as err:
        if os.environ.get("MHLA_GEN_TRACEBACK", "") not in ("", "0"):
            raise
        print(f"{Path(sys.argv[0]).name}: error: {one_line(err)}", file=sys.stderr)
        raise SystemExit(2) from None


def expand_path(text: str) -> str:
    """argparse ``type`` for paths: ``~`` expanded, as the shell does for unquoted words."""
    return os.path.expanduser(text)


def device_setting(value, flag: str = "--device", hint: str = ""):
    """``value`` as a ``torch.device``: a name torch parses (``cpu``, ``cuda``, ``cuda:1``), or None for
    ``cuda`` where there is one and ``cpu`` elsewhere. ``ConfigError`` naming ``flag`` for a name torch does
    not parse, or CUDA on a machine without it (``hint``: what to pass instead, in the message)."""
    import torch

    if value is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"{flag} {value!r}: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{flag} {value}: no CUDA device here" + (f" ({hint})" if hint else ""))
    return device


def parse_run_args(
    schema, description: str, default_config: str | None = None, argv: list[str] | None = None,
    parents: Sequence[argparse.ArgumentParser] = (),
):
    """``schema`` instance from ``--config FILE`` (default ``default_config``) and ``key=value`` overrides
    (OmegaConf dotlist, :func:`~mhla_gen.train.config.load_config`); sets up console logging. ``parents``:
    parsers of extra flags the script reads itself (shown in ``--help``)."""
    parser = argparse.ArgumentParser(description=description, parents=list(parents),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config",
        default=default_config,
        help="YAML listing deviations from the defaults: a path or a shipped config's name, e.g. tiny/dit "
        f"(`mhla-gen configs` lists them; default: {default_config or 'none, the built-in defaults'})",
    )
    parser.add_argument(
        "overrides", nargs="*", help="OmegaConf dotlist, e.g. train.max_steps=10 output_dir=runs/x"
    )
    args = parser.parse_args(argv)

    config = None if args.config is None else resolve_config(args.config, "--config")  # a path or a name
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate.checkpointing").setLevel(logging.WARNING)  # one INFO line per saved file
    logging.getLogger("accelerate.accelerator").setLevel(logging.WARNING)  # "Saving current state to ..."
    # (mhla_gen.train.checkpoint logs one line once a checkpoint is in place)
    from ..train.config import load_config

    return load_config(schema, config, args.overrides)


def linearize_main(argv: list[str] | None = None, callbacks: Sequence[TrainCallback] = (),
                   description: str = "Stage 1 of converting a pretrained model to MHLA.") -> Path:
    """``scripts/linearize.py``: ``--base NAME`` picks the base record (its config schema and task), then
    stage 1 (:class:`~mhla_gen.train.linearize.TransferTask`) runs through the training loop."""
    # here, not at the top: the dispatcher (`mhla-gen --help`) loads no training stack
    from ..train.linearize import TransferTask, stage1_schema
    from ..train.loop import train

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--base", choices=sorted(BASES), default=DEFAULT.name,
                        help=f"the model family: its config sections, data and conditioning (default: "
                             f"{DEFAULT.name})")
    base = trainable(parser.parse_known_args(argv)[0].base, "--base")
    cfg = parse_run_args(stage1_schema(base), description, None, argv, parents=[parser])
    return train(cfg, TransferTask(cfg, base.task.load()(cfg)), callbacks)


def trainable(name: str, setting: str):
    """The base record ``name``, when it has a training task; ConfigError naming ``setting`` otherwise."""
    record = base_for(name)
    if not record.trains:
        trained = sorted(n for n, b in BASES.items() if b.trains)
        raise ConfigError(f"{setting} {name}: this base has no training task yet (its record's task is None: "
                          f"it samples, installs, saves and loads only); bases that train: {trained}")
    return record


def train_main(
    base: str,
    description: str,
    default_config: str | None = None,
    argv: list[str] | None = None,
    callbacks: Sequence[TrainCallback] = (),
) -> Path:
    """The training scripts' ``main``: parse the command line into the run config of the base record named
    ``base`` (``dit``, ``sana``, ``wan``, ...), then :func:`~mhla_gen.train.loop.train` its task with
    ``callbacks``; returns ``final/``. ``description``: the ``--help`` text (the command's docstring, as
    written)."""
    from ..train.loop import train  # here: the dispatcher loads no training stack

    record = trainable(base, "base")
    cfg = parse_run_args(record.run_config.load(), description, default_config, argv)
    return train(cfg, record.task.load()(cfg), callbacks)


def command_parser(prog: str) -> argparse.ArgumentParser:
    """The top-level parser: ``--help`` lists every command with its one line; ``--version``."""
    width = max(map(len, COMMANDS)) + 2
    listing = "\n".join(f"  {name:<{width}}{command.summary}" for name, command in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog=prog, usage=f"{prog} [-h] [--version] COMMAND [ARGS ...]",
        description="MHLA (Multi-Head Linear Attention) for image and video diffusion: train, convert, "
                    "sample and evaluate.",
        epilog=f"commands:\n{listing}\n\n`{prog} COMMAND --help` shows a command's own options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mhla_gen {__version__}")
    parser.add_argument("command", metavar="COMMAND", choices=list(COMMANDS), help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "mhla-gen") -> None:
    """``mhla-gen COMMAND ARGS``: run the command's ``main(ARGS)`` through :func:`run` (its errors in one
    line, ``<prog> COMMAND: error: ...``, exit status 2). Only the chosen command's module is imported."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = command_parser(prog).parse_args(argv[:1]).command  # -h, --version, unknown names: argparse's
    module = importlib.import_module(COMMANDS[name].module)
    sys.argv = [f"{prog} {name}", *argv[1:]]  # the command's usage line and error prefix name it
    run(lambda: module.main(argv[1:]))


if __name__ == "__main__":
    main(prog="python -m mhla_gen.commands.cli")
