#!/usr/bin/env bash
# The papers' set-ups compiled for TPU slices by the TPU compiler (libtpu, no TPU needed): each
# preset on the smallest slice of the chip it is listed with that it fits (a chip alone: the
# search; CHIP-N: that slice), JSON in runs/plans/, then the table of every plan there (the
# README's). About an hour on 2 cores; needs the tpu extra.
#   bash launch/plan_presets.sh [PRESET=TARGET ...]        # e.g. portool-qwen2.5-7b-lora=v5e-8
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p runs/plans/presets
pairs=("$@")
[ ${#pairs[@]} -eq 0 ] && pairs=(
  portool-qwen3-1.7b=v5e portool-qwen3-1.7b-lora=v5e
  portool-qwen2.5-7b-lora=v5e-8 portool-qwen2.5-7b-lora=v5e portool-qwen2.5-7b=v5p
  llama-3.1-8b-lora=v5e llama-3.1-8b=v5p
  swirl-gemma-2-27b-lora=v5p swirl-gemma-2-27b=v5p)
for pair in "${pairs[@]}"; do
  preset=${pair%%=*} target=${pair#*=}
  echo "== $preset on $target"
  JAX_PLATFORMS=cpu timeout 3600 "$PY" -m steprl_jax.plan --preset "$preset" --target "$target" \
    --json "runs/plans/presets/$preset.$target.json" 2>&1 | grep -v "^WARNING\|^E0000\|Source Location\|libtpu_init\|^===\|Logging before"
done
"$PY" - <<'PY'
import glob, json

from steprl_jax.models.presets import preset
from steprl_jax.planning import roofline, targets

print("| preset | smallest slice it fits (TPU compiler) | per-chip peak | fits | slices tried (peak GiB) | "
      "train step: temporaries, roofline (estimate) |")
print("|---|---|---|---|---|---|")
for f in sorted(glob.glob("runs/plans/presets/*.json")):
    r = json.load(open(f))
    t, p = r["target"], r["programs"].get("train_step", {})
    if "roofline_seconds" not in p or "model_flops" not in p:  # plans written before the estimate
        target = targets.target(t["name"])
        roofline.estimate(r, preset(r["setup"]["model"]), target.chip, target.chips, target.one_host().chips)
    tried = ", ".join(f"{x['target']} {x['peak'] / 2**30:.0f}" for x in r.get("tried", [])[:-1]) or "-"
    step = f"{p['temporaries'] / 2**30:.1f} GiB, {p.get('roofline_seconds', 0):.2f} s" if p else ""
    print(f"| {f.split('/')[-1].rsplit('.', 2)[0]} | {t['name']} ({t['chips']} chips, {t['hosts']} host(s)) | "
          f"{r['phases']['peak'] / 2**30:.1f} of {t['hbm_per_chip'] / 2**30:.0f} GiB | "
          f"{'yes' if r['fits'] else 'NO'} ({r['used']:.0%}) | {tried} | {step} |")
PY
