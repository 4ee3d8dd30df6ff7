#!/bin/bash
# The GPU check, in one call (about 6 minutes on one GPU): fusion against HF transformers on the same
# GPU, then the seed's experiment whole, then the speed comparison.
#
#   1. parity: tests/test_gpu.py (N = 1, 2, 3; float32 exact, bfloat16 faithful; two workers sharing
#      the GPU over the links and over gloo)
#   2. `fusion audit run` at N = 2 on the Qwen2.5-1.5B-shaped random model (28 layers, 250 steps)
#   3. `fusion bench --device cuda`: HF transformers vs fusion N = 1 and 2 (tls links), decode and
#      prefill of 512 tokens, in float32 and in bfloat16
#
# Usage: bash scripts/gpu_check.sh [--device cpu]
#   --device cpu runs the same stages on the CPU with small shapes (a 2-layer random model, 16 audit
#   steps, 64-token prefill): how this script is tested on a machine without a GPU; the parity stage
#   then runs the CPU's bfloat16 tests (tests/test_dtype_parity.py) and shows test_gpu.py skipped.
#   OUT: the folder for the results (default out/gpu_check): check.log, parity.log, audit.log,
#   audit-summary.json, bench-float32.json, bench-bfloat16.json (ratios under "ratios").
#   A machine without a package registry: put the wheels it lacks in .whl/ in the project root
#   (wheel files only, never committed); they are installed into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
device=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1 (usage: [--device cpu|cuda])" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
work=$(mktemp -d /tmp/gpu_check.XXXXXX)
export PYTHONUNBUFFERED=1 FUSION_CACHE=${FUSION_CACHE:-/tmp/fusion-cache}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
log() { echo "gpu_check [$(date +%T), ${SECONDS}s]: $*" | tee -a "$OUT/check.log"; }
: >"$OUT/check.log"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" | tee -a "$OUT/check.log"
status=0

if [ "$device" = cpu ]; then
  model=$(python3 - "$work/model" <<'EOF'
import sys
from pathlib import Path
from fusion_compute.bench.models import QWEN2_5_1_5B, build_random
small = dict(QWEN2_5_1_5B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
print(build_random(Path(sys.argv[1]), small, shards=1))
EOF
)
  parity=(tests/test_gpu.py tests/test_dtype_parity.py -k "N1 or N2")
  steps=16 prompts=64 decode=8
else
  model=$(python3 -c "from fusion_compute.bench.models import qwen2_5_1_5b_shaped; print(qwen2_5_1_5b_shaped())")
  parity=(tests/test_gpu.py)
  steps=250 prompts=512 decode=32
fi
log "model $model"

log "1. parity with transformers on $device"
# -o addopts: pytest's plugins autoloaded here, not the ones pyproject.toml names (hypothesis among them),
# which a GPU machine given only the wheels it lacks may not have.
if python3 -m pytest -q -n 0 -p no:cacheprovider -o "addopts=-ra -p no:benchmark" -rs "${parity[@]}" >"$OUT/parity.log" 2>&1; then
  log "parity: $(tail -1 "$OUT/parity.log")"
else
  status=1; log "parity FAILED: $(tail -1 "$OUT/parity.log") (parity.log)"
fi

log "2. fusion audit run, N = 2, $steps steps, bfloat16 on $device"
if python3 -m fusion_compute audit run --model "$model" --workers 2 --steps "$steps" --cold-starts 1 \
    --device "$device" --dtype bfloat16 --no-exposure --out "$work/audit" >"$OUT/audit.log" 2>&1; then
  log "audit: $(grep -m1 '^audit ' "$OUT/audit.log" || tail -1 "$OUT/audit.log")"
else
  status=1; log "audit FAILED: $(tail -1 "$OUT/audit.log") (audit.log)"
fi
cp "$work/audit/summary.json" "$OUT/audit-summary.json" 2>/dev/null || true

for dtype in float32 bfloat16; do
  log "3. fusion bench, $device $dtype: transformers, fusion N = 1 and 2 (tls)"
  if python3 -m fusion_compute bench --model "$model" --device "$device" --dtype "$dtype" --workers 2 \
      --comm-backends tls --no-megatron --repeats 1 --prompts "$prompts" --decode-tokens "$decode" \
      --out "$work/bench-$dtype" --json >"$OUT/bench-$dtype.json" 2>>"$OUT/check.log"; then
    python3 - "$OUT/bench-$dtype.json" <<'EOF' | tee -a "$OUT/check.log"
import json, sys
r = json.load(open(sys.argv[1]))
for row in r["results"]:
    pre = ", ".join(f"prefill {p}: {row[f'prefill_{p}_tokens_per_s']:.1f}" for p in r["prompts"])
    print(f"  {row['system']} N={row['workers']}: decode {row['decode_tokens_per_s']:.2f} tok/s, {pre} tok/s")
for k, v in r["ratios"].items():
    if "vs_transformers" in k or "vs_fusion1" in k:
        print(f"  {k}: {v:.3f}")
EOF
  else
    status=1; log "bench $dtype FAILED (check.log)"
  fi
done
rm -rf "$work"
log "done, status $status"
exit $status
