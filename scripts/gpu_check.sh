#!/usr/bin/env bash
# On the GPU machine (the device tool runs this in the checkout's root; results go to $OUT).
#
#   bash scripts/gpu_check.sh install     # each call that carries .whl/a or .whl/b
#   bash scripts/gpu_check.sh tests       # the tests marked gpu, and the OOM benchmark
#   bash scripts/gpu_check.sh bench ARGS  # python benchmarks/ARGS, e.g. train_memory.py --gpu-id 0
#
# Packages go to /tmp/site, which lasts as long as the machine is held (warm); every
# step sets PYTHONPATH to the checkout first, then /tmp/site.
set -uo pipefail
SITE=/tmp/site
OUT=${OUT:-/tmp/out}
mkdir -p "$SITE" "$OUT"
export PYTHONPATH="$PWD:$SITE" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
case "${1:-}" in
  install)
    for dir in .whl/a .whl/b; do
      [ -d "$dir" ] || continue
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$dir"/*.whl || exit 1
      echo "installed $dir"
    done
    python3 -c "import spacy, thinc, spacy_transformers, transformers, torch, cupy; \
print('spacy', spacy.__version__, 'thinc', thinc.__version__, 'transformers', transformers.__version__, \
'torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0), \
'cupy', cupy.__version__)" 2>&1 | tail -3
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    ;;
  tests)
    python3 -m spacy lean --help > /dev/null || { echo "spacy lean is not registered"; exit 1; }
    python3 -m pytest -q -m gpu -rs tests 2>&1 | tee "$OUT/gpu_tests.log"
    status=${PIPESTATUS[0]}
    python3 benchmarks/oom_gpu.py --output "$OUT/oom_gpu.json" > "$OUT/oom_gpu.log" 2>&1
    echo "oom_gpu.py: rc $? (log and JSON in \$OUT)"
    exit "$status"
    ;;
  bench)
    shift
    script=$1
    shift
    python3 "benchmarks/$script" "$@" 2>&1 | tee "$OUT/${script%.py}.log"
    ;;
  *)
    echo "usage: bash scripts/gpu_check.sh install | tests | bench SCRIPT [ARGS]" >&2
    exit 2
    ;;
esac
