#!/bin/bash
# The GPU checks, as one time-boxed script (for a lent GPU machine with PyTorch, GPyTorch and linear_operator
# installed; run from the repository root): the tests marked `cuda`, `decoupled-step --device cuda` and `cuda-step`.
# Results and logs go to $OUT (default: a fresh temporary folder); kin40k must be in $GPYTORCH_DECOUPLED_DATA.
#   OUT=/tmp/gpu PARTS="tests step cuda" T_TESTS=150 T_STEP=90 T_CUDA=240 bash benchmarks/gpu_checks.sh
# Copy decoupled-step-cuda.json and cuda-step.json from $OUT to benchmarks/results/ to commit them.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} GPYTORCH_DECOUPLED_DOWNLOAD=0
OUT=${OUT:-$(mktemp -d)}
PARTS=${PARTS:-"tests step cuda"}
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import sys, torch, gpytorch, linear_operator as lo; print(sys.version.split()[0], torch.__version__,
gpytorch.__version__, lo.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
if [[ $PARTS == *tests* ]]; then
  FILES=$(grep -rl "mark.cuda" tests --include='*.py' | sort)
  timeout "${T_TESTS:-150}" python3 -m pytest -p no:cacheprovider -m cuda -n 3 -q -rs --tb=short $FILES \
    > "$OUT/pytest-cuda.log" 2>&1
  echo "pytest rc $? at $(( $(date +%s) - T0 )) s"; tail -5 "$OUT/pytest-cuda.log"
fi
if [[ $PARTS == *step* ]]; then
  timeout "${T_STEP:-90}" python3 -m benchmarks decoupled-step --device cuda --no-progress --output-dir "$OUT" \
    > "$OUT/decoupled-step-cuda.log" 2>&1
  echo "decoupled-step rc $? at $(( $(date +%s) - T0 )) s"; tail -12 "$OUT/decoupled-step-cuda.log"
fi
if [[ $PARTS == *cuda* ]]; then
  timeout "${T_CUDA:-240}" python3 -m benchmarks cuda-step --steps "${STEPS:-80}" --output "$OUT/cuda-step.json" \
    > "$OUT/cuda-step.log" 2>&1
  echo "cuda-step rc $? at $(( $(date +%s) - T0 )) s"; grep "median step\|skips [1-9]\|failed\|_b" "$OUT/cuda-step.log"
fi
echo "results in $OUT"
