"""What every entry point (scripts/, eval/) does with a user's mistake: one line, exit status 2.

Settings are checked at start-up and raise :class:`~mhla_gen.errors.ConfigError` (a ``ValueError``)
or ``FileNotFoundError`` with a message naming the setting or path. A traceback through OmegaConf and the
training loop adds nothing to that message, so :func:`run` prints ``<program>: error: <message>`` (as
argparse does for bad flags) and exits with 2. Called in-process (``main(argv)``, the tests), the
exceptions propagate unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def run(main: Callable[[], object]) -> None:
    """Call ``main()``; a ConfigError or FileNotFoundError becomes a one-line message and exit status 2."""
    from .errors import ConfigError

    try:
        main()
    except (ConfigError, FileNotFoundError) as err:
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
