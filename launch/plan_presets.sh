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
print("| preset | slice (smallest that fits, from the compiler) | per-chip peak | HBM | fits | tried | "
      "train step: compile, temporaries, roofline (estimate) |")
print("|---|---|---|---|---|---|---|")
for f in sorted(glob.glob("runs/plans/presets/*.json")):
    r = json.load(open(f))
    if "target" not in r:
        continue
    t, p = r["target"], r["programs"].get("train_step", {})
    tried = ", ".join(f"{x['target']} {x['peak'] / 2**30:.0f}" for x in r.get("tried", [])[:-1]) or "-"
    step = (f"{p['compile_seconds']:.0f} s, {p['temporaries'] / 2**30:.1f} GiB, "
            f"{p.get('roofline_seconds', 0) * 1e3:.0f} ms") if p else ""
    print(f"| {f.split('/')[-1].rsplit('.', 2)[0]} | {t['name']} ({t['chips']} chips, {t['hosts']} host(s)) | "
          f"{r['phases']['peak'] / 2**30:.1f} GiB | {t['hbm_per_chip'] / 2**30:.0f} GiB | "
          f"{'yes' if r['fits'] else 'NO'} ({r['used']:.0%}) | {tried} | {step} |")
PY
