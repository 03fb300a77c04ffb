#!/usr/bin/env bash
# The device check on a bare image (torch with CUDA, no network, no Transformer Engine, no megatron).
#
#   benchmarks/gpu_check.sh download WHEELS [PYTHON_VERSION]   # on a machine with a registry: fetch the pinned
#                                                               # wheels for the GPU image (default Python 3.12)
#   benchmarks/gpu_check.sh run WHEELS [gpu_check.py args...]  # on the GPU image: install offline, then check
#
# PYTHON picks the interpreter (default python3). The run prints one JSON line per check (see gpu_check.py).
set -euo pipefail

usage() { sed -n '2,8p' "$0" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
mode=$1 wheels=$2
shift 2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
requirements="$here/gpu_check.requirements.txt"
python=${PYTHON:-python3}

case "$mode" in
download)
    version=${1:-3.12}
    "$python" -m pip download --no-deps --only-binary :all: --python-version "$version" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        --dest "$wheels" -r "$requirements"
    ;;
run)
    "$python" -m pip install --quiet --no-index --no-deps --find-links "$wheels" -r "$requirements"
    "$python" -c 'import torch; print("gpu_check: torch", torch.__version__, "cuda", torch.version.cuda)' >&2
    exec "$python" "$here/gpu_check.py" "$@"
    ;;
*) usage ;;
esac
