"""``python -m mhla_gen COMMAND ARGS``: the ``mhla-gen`` command (:func:`mhla_gen.commands.cli.main`)."""

from mhla_gen.commands.cli import main

if __name__ == "__main__":
    main(prog="python -m mhla_gen")
