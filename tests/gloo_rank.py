"""A repository script on a gloo CPU rank, left without the interpreter's teardown (test only).

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 tests/gloo_rank.py SCRIPT.py ARGS...

Runs ``scripts/SCRIPT.py``'s ``main`` unchanged, with the same one-line errors
(``mhla_gen.commands.cli.run``), then leaves through :func:`exit_without_teardown`. Used by
``run_torchrun`` (tests/train_helpers.py) for the DDP tests, and by tests/fsdp_on_cpu.py.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

from script_helpers import load_script

REPO = Path(__file__).resolve().parents[1]


def run_script(script: str, argv: list[str]) -> None:
    """``scripts/<script>`` run as ``python scripts/<script> argv`` runs it (one-line errors, exit 2)."""
    module = load_script(REPO / "scripts" / script, "_script")
    from mhla_gen.commands.cli import run

    sys.argv = [script, *argv]
    run(lambda: module.main(argv))


def exit_without_teardown() -> None:
    """After the script returned: flush, run the atexit handlers (the folder locks' release), and leave
    through ``os._exit(0)``, skipping the interpreter's and C++'s teardown. On gloo CPU ranks that teardown
    can abort a finished process: once in CI (2026-11-29) rank 1 of an FSDP run that had written
    everything died with SIGABRT, "terminate called without an active exception", after the last barrier
    and ``destroy_process_group`` (Gloo's worker threads and objects freed while the interpreter goes
    down; torch's own tests destroy their groups explicitly for the same reason). Users' ranks run on
    NCCL; only these test launches run on gloo. A script that fails raises before this and keeps its own
    exit status."""
    import gc

    gc.collect()  # what is still alive, freed while the interpreter is
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_script(sys.argv[1], sys.argv[2:])
    exit_without_teardown()
