"""List the configs that ship with mhla_gen, or print the path of one.

    mhla-gen configs                     # every name: dit_digits, tiny/dit, linearize/..., accelerate/...
    mhla-gen configs dit_digits          # its file: cp "$(mhla-gen configs dit_digits)" my.yaml to start one
    accelerate launch --config_file "$(mhla-gen configs accelerate/ddp)" -m mhla_gen train-dit --config ...

Every ``--config`` takes these names as well as paths (``mhla_gen.configs``); the path is for tools that
read the file themselves, such as ``accelerate launch --config_file``.
"""

from __future__ import annotations

import argparse

from mhla_gen.configs import shipped_config, shipped_configs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", default=None, help="a shipped config (print its path)")
    args = parser.parse_args(argv)
    if args.name is None:
        print("\n".join(shipped_configs()))
        return
    path = shipped_config(args.name)
    if path is None:
        names = ", ".join(shipped_configs())
        raise FileNotFoundError(f"no shipped config {args.name!r}; shipped configs: {names}")
    print(path)
