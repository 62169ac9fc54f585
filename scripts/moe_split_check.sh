#!/usr/bin/env bash
# moe_split_check.sh BIN_DIR MODELS_DIR — on a GPU machine, check and time per-expert placement (FLUX_MOE_SPLIT)
# with llama.cpp's own tools built from the patched source (llama-bench, llama-perplexity in BIN_DIR) on the twins
# of scripts/moe_split_twins.py (MODELS_DIR). Prints:
#   - KL of splits vs all experts on the host, next to plain GPU placements (the kernels' rounding), 16-token batches;
#   - decode tok/s: all experts on the host, splits of 32 and 64 hot experts per layer with and without
#     FLUX_MOE_HOST_SYNC, whole expert layers in the same VRAM, on the skewed and the uniform twin;
#   - FLUX_MOE_HOST_PROFILE lines with and without overlap, and pp512 with and without a split.
# Numbers of one H200 run: patches/llama.cpp/README.md.
set -uo pipefail
B=${1:?usage: moe_split_check.sh BIN_DIR MODELS_DIR}; M=${2:?usage: moe_split_check.sh BIN_DIR MODELS_DIR}
LG=$(mktemp -d); T=${THREADS:-$(nproc)}
split() { cat "$M/split-$1-$2.env"; }
kl() { echo "KL $1: $(grep -E 'Mean    KLD|Maximum KLD|Same top p' "$LG/kl.log" | tr -s ' ' | tr '\n' ' ')"; }
S=$M/qwen3-30b-a3b-skewed.gguf
P=(-m "$S" -f "$M/text.txt" -c 256 -b 16 -ub 16 --chunks 4 -ngl 99 -fa on -t "$T")
HOST=(-ot 'exps=CPU')
"$B/llama-perplexity" "${P[@]}" "${HOST[@]}" --kl-divergence-base "$LG/base.kld" > "$LG/base.log" 2>&1 || tail -3 "$LG/base.log"
for h in 8 32; do for sync in 0 1; do
  FLUX_MOE_HOST_SYNC=$sync FLUX_MOE_SPLIT=$(split qwen3-30b-a3b $h) "$B/llama-perplexity" "${P[@]}" "${HOST[@]}" \
    --kl-divergence-base "$LG/base.kld" --kl-divergence > "$LG/kl.log" 2>&1; kl "split $h hot/layer, host sync $sync"
done; done
"$B/llama-perplexity" "${P[@]}" -ot 'blk\.(1[2-9]|[2-4][0-9])\.ffn_.*_exps=CPU' --kl-divergence-base "$LG/base.kld" \
  --kl-divergence > "$LG/kl.log" 2>&1; kl "12 whole expert layers on the GPU"
"$B/llama-perplexity" "${P[@]}" --kl-divergence-base "$LG/base.kld" --kl-divergence > "$LG/kl.log" 2>&1; kl "every expert on the GPU"

BB=(-ngl 99 -fa 1 -t "$T" -p 0 -n 32 -r "${REPS:-3}")
tg() { grep "tg32" "$LG/tg.md" | awk -F'|' '{print $(NF-1)}'; }
for tw in skewed uniform; do L=$M/qwen3-30b-a3b-$tw.gguf
  "$B/llama-bench" -m "$L" "${BB[@]}" "${HOST[@]}" > "$LG/tg.md" 2>&1; echo "$tw, all experts on the host: $(tg)"
  for h in 32 64; do for sync in 0 1; do
    FLUX_MOE_HOST_SYNC=$sync FLUX_MOE_SPLIT=$(split qwen3-30b-a3b $h) "$B/llama-bench" -m "$L" "${BB[@]}" "${HOST[@]}" > "$LG/tg.md" 2>&1
    echo "$tw, $h hot experts/layer, host sync $sync: $(tg)"; done; done
  "$B/llama-bench" -m "$L" "${BB[@]}" -ot 'blk\.(1[2-9]|[2-4][0-9])\.ffn_.*_exps=CPU' > "$LG/tg.md" 2>&1; echo "$tw, 12 expert layers on the GPU: $(tg)"
  "$B/llama-bench" -m "$L" "${BB[@]}" -ot 'blk\.(2[4-9]|3[0-9]|4[0-7])\.ffn_.*_exps=CPU' > "$LG/tg.md" 2>&1; echo "$tw, 24 expert layers on the GPU: $(tg)"
done
for sync in 0 1; do echo "profile, 32 hot experts/layer, host sync $sync:"
  FLUX_MOE_HOST_PROFILE=16 FLUX_MOE_HOST_SYNC=$sync FLUX_MOE_SPLIT=$(split qwen3-30b-a3b 32) \
    "$B/llama-bench" -m "$S" "${BB[@]}" "${HOST[@]}" 2>&1 | grep flux-moe-host-profile | sed -n 2,4p; done
for v in X=none "FLUX_MOE_SPLIT=$(split qwen3-30b-a3b 32)"; do
  env "$v" "$B/llama-bench" -m "$S" -ngl 99 -fa 1 -t "$T" -p 512 -n 0 -r 3 "${HOST[@]}" > "$LG/pp.md" 2>&1
  echo "pp512 ${v%%=*}: $(grep pp512 "$LG/pp.md" | awk -F'|' '{print $(NF-1)}')"; done
rm -rf "$LG"
