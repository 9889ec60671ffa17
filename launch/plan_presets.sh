#!/usr/bin/env bash
# The papers' set-ups compiled for TPU slices by the TPU compiler (libtpu, no TPU needed): one
# plan per preset on the slice it is listed with, JSON in runs/plans/, a table on stdout
# (README's "Memory plans"). Takes tens of minutes on 2 cores; needs the tpu extra.
#   bash launch/plan_presets.sh [PRESET=TARGET ...]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p runs/plans
pairs=("$@")
[ ${#pairs[@]} -eq 0 ] && pairs=(
  portool-qwen3-1.7b=v5e-8 portool-qwen3-1.7b-lora=v5e-8
  portool-qwen2.5-7b-lora=v5e-8 portool-qwen2.5-7b=v5p-8
  llama-3.1-8b-lora=v5e-8 llama-3.1-8b=v5p-8
  swirl-gemma-2-27b-lora=v5p-16 swirl-gemma-2-27b=v5p-32)
for pair in "${pairs[@]}"; do
  preset=${pair%%=*} target=${pair#*=}
  echo "== $preset on $target"
  JAX_PLATFORMS=cpu timeout 3600 "$PY" -m steprl_jax.plan --preset "$preset" --target "$target" \
    --json "runs/plans/$preset.$target.json" 2>&1 | grep -v "^WARNING\|^E0000\|Source Location\|libtpu_init\|^===\|Logging before"
done
"$PY" - <<'PY'
import glob, json
print("| preset | slice | per-chip peak (GiB) | HBM | fits | train step roofline (estimate) |")
print("|---|---|---|---|---|---|")
for f in sorted(glob.glob("runs/plans/*.json")):
    r = json.load(open(f))
    if "target" not in r or "preset" not in f.split("/")[-1] and r["setup"].get("decode_batch", 0) == 0:
        continue
    t, p = r["target"], r["programs"].get("train_step", {})
    roof = f"{p['roofline_seconds'] * 1e3:.0f} ms" if "roofline_seconds" in p else ""
    print(f"| {f.split('/')[-1].rsplit('.', 2)[0]} | {t['name']} ({t['chips']} chips) | "
          f"{r['phases']['peak'] / 2**30:.1f} | {t['hbm_per_chip'] / 2**30:.0f} | "
          f"{'yes' if r['fits'] else 'NO'} ({r['used']:.0%}) | {roof} |")
PY
