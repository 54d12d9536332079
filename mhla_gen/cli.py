"""What every entry point (scripts/, eval/, ``python -m mhla_gen.adopt``) does with a user's mistake:
one line, exit status 2.

Settings and paths are checked at start-up, before anything is written, and raise
:class:`~mhla_gen.errors.ConfigError` (a ``ValueError``), ``FileNotFoundError`` or another ``OSError``
with a message naming the setting or path. A traceback through OmegaConf and the training loop adds
nothing to that message, so :func:`run` prints ``<program>: error: <message>`` on one line (as argparse
does for bad flags) and exits with 2. ``MHLA_GEN_TRACEBACK=1`` in the environment shows the traceback
instead. Called in-process (``main(argv)``, the tests), the exceptions propagate unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

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
