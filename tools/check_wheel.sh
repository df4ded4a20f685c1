#!/usr/bin/env bash
# Checks comera as a library a user installs, not as this checkout:
#   1. builds the sdist and, from it, the wheel (python -m build) into a temporary folder;
#   2. twine check --strict on both, and their contents (every module of src/comera in the wheel, py.typed,
#      LICENSE; the sdist's tests and changelog);
#   3. a fresh virtual environment with the wheel installed (through constraints.txt, so torch is the pinned
#      CPU build; --no-compile: no .pyc for torch's ~15,000 files, slow to write and to delete), pip check, then `import comera`, a TT layer's forward and `comera --help`, run outside the
#      checkout with PYTHONPATH unset, so that nothing is read from src/.
# --extras: also, for each optional extra (hf, baselines, bench, parquet, examples, zstd, dev), a fresh virtual
# environment with comera[EXTRA] installed from the wheel and the modules that extra is for imported. Each one
# installs torch again: a few minutes in all, so not part of the default check.
#
# Usage: tools/check_wheel.sh [--extras] [--keep]     (--keep: leave the temporary folder and say where)
# BUILD_PYTHON: the interpreter with build and twine (default .venv/bin/python, which `make install-dev` makes).
# BASE_PYTHON: the interpreter the fresh environments are made from (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

EXTRAS=0
KEEP=0
for arg in "$@"; do
    case $arg in
        --extras) EXTRAS=1 ;;
        --keep) KEEP=1 ;;
        -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "check_wheel: unknown argument $arg (--extras, --keep)" >&2; exit 2 ;;
    esac
done

BUILD_PYTHON=${BUILD_PYTHON:-.venv/bin/python}
BASE_PYTHON=${BASE_PYTHON:-python3}
CONSTRAINTS=$ROOT/constraints.txt
unset PYTHONPATH

TMP=$(mktemp -d "${TMPDIR:-/tmp}/comera-check-wheel.XXXXXX")
if [ "$KEEP" = 1 ]; then
    trap 'echo "check_wheel: files kept in $TMP"' EXIT
else
    trap 'rm -rf "$TMP"' EXIT
fi
mkdir "$TMP/logs"
START=$SECONDS

# run NAME COMMAND...: runs the command with its output in logs/NAME.log; on failure prints the log's tail.
run() {
    local name=$1
    shift
    local t0=$SECONDS
    if ! "$@" >"$TMP/logs/$name.log" 2>&1; then
        echo "FAIL $name: $*" >&2
        tail -n 40 "$TMP/logs/$name.log" >&2
        exit 1
    fi
    echo "ok   $name ($((SECONDS - t0)) s)"
}

# new_venv DIR: a fresh virtual environment made from BASE_PYTHON.
new_venv() {
    "$BASE_PYTHON" -m venv "$1"
}

run build "$BUILD_PYTHON" -m build --outdir "$TMP/dist" .
WHEEL=$(ls "$TMP"/dist/comera-*.whl)
SDIST=$(ls "$TMP"/dist/comera-*.tar.gz)
echo "     $(basename "$WHEEL") $(($(stat -c %s "$WHEEL") / 1024)) KiB, $(basename "$SDIST") $(($(stat -c %s "$SDIST") / 1024)) KiB"
run twine "$BUILD_PYTHON" -m twine check --strict "$WHEEL" "$SDIST"
run contents "$BUILD_PYTHON" - "$WHEEL" "$SDIST" <<'EOF'
import sys
import tarfile
import zipfile
from pathlib import Path

wheel, sdist = sys.argv[1:]
names = set(zipfile.ZipFile(wheel).namelist())
modules = {str(path.relative_to("src")) for path in Path("src/comera").rglob("*.py")}
missing = sorted(modules - names)
assert not missing, f"modules of src/comera missing from the wheel: {missing[:10]} ({len(missing)} in all)"
assert "comera/py.typed" in names, "py.typed missing from the wheel"
info = {name.split("/")[0] for name in names if ".dist-info/" in name}
assert len(info) == 1, info
assert f"{info.pop()}/licenses/LICENSE" in names, "LICENSE missing from the wheel"
tops = {name.split("/")[0] for name in names if ".dist-info/" not in name}
assert tops == {"comera"}, f"the wheel installs more than the comera package: {sorted(tops)}"
members = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
for needed in (
    "LICENSE", "CHANGELOG.md", "README.md", "constraints.txt", "tests/conftest.py", "src/comera/py.typed",
    "examples/hf_llama_pretrain.py",
):
    assert needed in members, f"{needed} missing from the sdist"
print(f"wheel: {len(modules)} modules and py.typed; sdist: {len(members)} entries")
EOF
echo "     $(cat "$TMP/logs/contents.log")"

VENV=$TMP/venv
run venv new_venv "$VENV"
run install "$VENV/bin/pip" install --no-compile --constraint "$CONSTRAINTS" "$WHEEL"
run pip-check "$VENV/bin/pip" check
cd "$TMP"
run import "$VENV/bin/python" - "$VENV" "$(basename "$WHEEL" | cut -d- -f2)" <<'EOF'
import sys
from pathlib import Path

import torch

import comera

venv, version = sys.argv[1:]
origin = Path(comera.__file__).resolve()
assert origin.is_relative_to(Path(venv).resolve()), f"comera imported from {origin}, not the fresh venv"
assert comera.__version__ == version, (comera.__version__, version)
assert (origin.parent / "py.typed").is_file(), "py.typed not installed"
layer = comera.TTLinear(64, 48, rank=4)
assert layer(torch.randn(3, 64)).shape == (3, 48)
print(f"comera {comera.__version__} from {origin.parent}, torch {torch.__version__}")
EOF
echo "     $(cat "$TMP/logs/import.log")"
run cli "$VENV/bin/comera" --help
echo "     $(head -n 1 "$TMP/logs/cli.log")"
cd "$ROOT"

if [ "$EXTRAS" = 1 ]; then
    # check_extra EXTRA PYTHON_CODE: comera[EXTRA] into a fresh venv, then the code run there.
    check_extra() {
        local extra=$1 code=$2
        local venv=$TMP/venv-$extra
        run "venv-$extra" new_venv "$venv"
        run "install-$extra" "$venv/bin/pip" install --no-compile --constraint "$CONSTRAINTS" "comera[$extra] @ file://$WHEEL"
        run "pip-check-$extra" "$venv/bin/pip" check
        (cd "$TMP" && run "import-$extra" "$venv/bin/python" -c "$code")
    }
    check_extra hf "import accelerate, transformers
from comera.integrations.hf_trainer import CoMERATrainer
from comera.integrations.hf_stages import CoMERACallback
import comera.workloads.mlm.hf_model"
    check_extra baselines "from comera.methods.projected import require_package
require_package('galore_torch', 'galore-torch', 'galore')
require_package('apollo_torch', 'apollo-torch', 'apollo')"
    # Nothing in comera imports psutil yet: the bench extra is checked for installing and importing only.
    check_extra bench "import psutil, comera.bench"
    check_extra parquet "import pyarrow.parquet, comera.data.corpus"
    check_extra examples "import datasets, comera"
    check_extra zstd "import zstandard, comera.data.files"
    check_extra dev "import build, hypothesis, pytest, scipy, sklearn, twine, comera
import subprocess, sys
subprocess.run([sys.executable, '-m', 'ruff', '--version'], check=True)"
fi

if [ "$KEEP" = 0 ]; then
    rm -rf "$TMP" # here rather than in the trap, so that the time below counts it (a venv with torch is ~1 GB)
    trap - EXIT
fi
echo "check_wheel: passed in $((SECONDS - START)) s"
