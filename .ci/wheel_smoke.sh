#!/usr/bin/env bash
# What `pip install mhla_gen` gives, with no checkout anywhere on sys.path: build the wheel from the
# checkout's files, install it into a fresh virtualenv outside the checkout, and from an empty folder run
# `mhla-gen --help`, every subcommand's --help, the README's main job at smoke size (train, sample, score),
# then generate -> fid and attention-stats on its output. Dependencies come from the virtualenv that runs
# this script (a .pth line puts its site-packages after the new one's), so nothing is downloaded.
#
#   bash .ci/wheel_smoke.sh            (with the project's virtualenv's python first on PATH, as .ci/run does)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=$(command -v python)
work=$(mktemp -d "${TMPDIR:-/tmp}/mhla_gen_wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT  # the folder this script made, nothing else
step() { echo "wheel smoke [$SECONDS s]: $*"; }

step "building from $repo"
mkdir "$work/src"  # only what the wheel is made of, as tracked (no stale build/ of an earlier build)
git -C "$repo" ls-files -z --cached --others --exclude-standard -- pyproject.toml README.md LICENSE mhla_gen \
    | (cd "$repo" && tar --null -T - -cf -) | tar -xf - -C "$work/src"
"$python" -m pip wheel --quiet --no-deps --no-build-isolation --no-index --wheel-dir "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/mhla_gen-*.whl)

"$python" -m venv --without-pip "$work/venv"  # installed into by this venv's pip (--python)
deps=$("$python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "$deps" > "$site/mhla_gen_smoke_deps.pth"  # a plain path: that folder's own .pth files are not run
"$python" -m pip --python "$work/venv/bin/python" install --quiet --no-deps --no-index "$wheel"

mkdir "$work/run" && cd "$work/run"  # an empty folder: no checkout, no configs/ beside the commands
export PATH="$work/venv/bin:$PATH" OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false
unset PYTHONPATH
where=$(python -c 'import mhla_gen; print(mhla_gen.__file__)')
case "$where" in "$site"/*) ;; *) echo "mhla_gen imported from $where, not the wheel"; exit 1 ;; esac
step "$(basename "$wheel") installed; mhla_gen from $where"

mhla-gen --help > help.txt
python -m mhla_gen --version
python - <<'EOF'  # every subcommand's own --help, in one process (each would import torch otherwise)
import contextlib, io, sys
from mhla_gen.commands.cli import main
from mhla_gen.commands import COMMANDS
help_text = open("help.txt").read()
for name in COMMANDS:
    assert f"  {name} " in help_text, f"mhla-gen --help does not list {name}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([name, "--help"])
    assert out.getvalue().startswith("usage: "), (name, out.getvalue()[:300])
print(f"{len(COMMANDS)} subcommands answer --help")
EOF
test "$(mhla-gen configs tiny/dit)" = "$site/mhla_gen/configs/tiny/dit.yaml"

# the README's main job (the default config, dit_digits) at smoke size: train, sample, digits-FID
step "mhla-gen train-dit (the main job, 4 steps)"
mhla-gen train-dit output_dir=runs/main train.max_steps=4 train.checkpoint_every=4 train.global_batch_size=16 \
    log.every=2 log.sample_steps=2 eval.fid_num_samples=20 eval.fid_batch_size=20 2>&1 | tail -n 3
test -f runs/main/final/config.json && test -f runs/main/samples/step_0000004.png
grep -q fid_digits runs/main/metrics.jsonl
# sample -> score, joined by files, and a statistic of the trained model; a config by its shipped name
step "mhla-gen generate -> fid, attention-stats"
mhla-gen generate --config eval/dit_digits run_config=runs/main/config.yaml output_dir=samples/main \
    num_per_item=2 steps=2 batch_size=20 2>&1 | tail -n 1
mhla-gen fid --samples samples/main --ref digits --num 20 | tail -n 1
mhla-gen attention-stats --model runs/main/final --digits --batch 1 > /dev/null
test -f samples/main.fid.json && test -f runs/main/attention_stats/attention_stats.json
step "passed"
