#!/usr/bin/env bash
# Run the Megatron tests against megatron-core 0.19.2 in a throwaway venv (not part of `make test`).
#
#   bash tests/megatron_019.sh            # venv at /tmp/venv019 (reused when already there)
#   VENV=/tmp/other bash tests/megatron_019.sh
#
# megatron-core >= 0.17 declares Python >= 3.12; this machine has 3.11 and a cp311 CPU torch.
# The 0.19.2 wheel is pure Python apart from megatron/core/datasets/helpers_cpp (cp312, unused
# here), so it is installed with its tag relaxed and --ignore-requires-python. triton is needed
# because 0.19 imports it unconditionally (transformer/moe/ops/paged_stash.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/venv019}
PY="$VENV/bin/python"
if ! "$PY" -c 'import megatron.core as m, sys; sys.exit(m.__version__ != "0.19.2")' 2>/dev/null; then
    python3.11 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q numpy==2.4.6 packaging triton psutil pytest
    WHL=$(mktemp -d)
    "$PY" -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: megatron-core==0.19.2 -d "$WHL"
    mv "$WHL"/megatron_core-0.19.2-*.whl "$WHL/megatron_core-0.19.2-py3-none-any.whl"
    "$PY" -m pip install -q --no-deps --ignore-requires-python "$WHL/megatron_core-0.19.2-py3-none-any.whl"
fi
"$PY" -c 'import megatron.core as m; print("megatron-core", m.__version__)'
exec "$PY" -m pytest -q -p no:cacheprovider tests/test_megatron_args.py tests/test_megatron.py "$@"
