#!/usr/bin/env bash
# test/cuda_compat.sh: which GPUs a build runs on. `ferry version` names the architectures the
# kernels were compiled for (-Dgpu_arch). On the CUDA emulator (test/cudaemu), which can pose as
# another GPU or driver (FY_EMU_CC, FY_EMU_OPTIN_SMEM, FY_EMU_NO_IMAGE, FY_EMU_*_DRIVER), ferry
# is checked to refuse before anything runs, saying what to do: a GPU older than compute
# capability 8.0, a GPU with no code in the build, a driver older than the runtime or none, GPUs hidden by
# CUDA_VISIBLE_DEVICES, and fp32 attention whose blocks need more shared memory than the GPU
# allows (heads of 128 on an RTX 40xx's 99 KiB), while bf16 trains there with the same losses as
# on an H100's 227 KiB. On a real GPU only the version line and a short run on it are checked.
#
# usage: test/cuda_compat.sh FERRY DIR
# Exit status: 0 when every check holds, 1 otherwise, 2 for bad usage.
set -uo pipefail

[ $# -eq 2 ] || { sed -n '11,12p' "$0" >&2; exit 2; }
ferry="$1" d="$2"
[ -x "$ferry" ] || { echo "cuda_compat.sh: $ferry is not a program" >&2; exit 2; }
mkdir -p "$d" || exit 2
fail() { echo "cuda_compat: $*"; exit 1; }

"$ferry" version >"$d/version.out" 2>&1 || fail "ferry version failed"
grep -q "^CUDA: " "$d/version.out" || { cat "$d/version.out"; fail "ferry version names no CUDA architectures"; }
grep -q "not built" "$d/version.out" && fail "this ferry has no CUDA backend"

# A model with heads of 128 (OPT-6.7B's and larger): hidden 256, 2 heads, one layer.
mkdir -p "$d/hs128"
cat >"$d/hs128/config.json" <<'EOF'
{"model_type": "opt", "vocab_size": 300, "hidden_size": 256, "num_attention_heads": 2, "num_hidden_layers": 1,
 "ffn_dim": 512, "max_position_embeddings": 64, "word_embed_proj_dim": 256, "do_layer_norm_before": true,
 "activation_function": "relu", "enable_bias": true, "layer_norm_elementwise_affine": true,
 "tie_word_embeddings": true, "init_std": 0.02, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2}
EOF
run=(train --model "$d/hs128" --steps 3 --batch 2 --seq 32 --seed 3 --warmup 0 --no-shuffle --device cuda)

# refused NAME PATTERN ENV... -- ARGS...: ferry ARGS under ENV fails, says PATTERN, and took no step
refused() {
  local name="$1" pat="$2"
  shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  if env "${envs[@]}" "$ferry" "$@" >"$d/$name.out" 2>&1; then
    cat "$d/$name.out"; fail "$name: ran"
  fi
  grep -q -- "$pat" "$d/$name.out" || { cat "$d/$name.out"; fail "$name: the refusal does not say '$pat'"; }
  grep -q "^step " "$d/$name.out" && { cat "$d/$name.out"; fail "$name: refused only after training began"; }
  echo "refused as it should be ($name): $(grep -m1 'error' "$d/$name.out")"
}
losses() { python3 -c 'import json,sys; print(" ".join(str(json.loads(l)["loss"]) for l in open(sys.argv[1]) if l.startswith("{")))' "$1"; }

if ! grep -q "emulator" "$d/version.out"; then
  "$ferry" "${run[@]}" --log "$d/gpu.jsonl" >"$d/gpu.out" 2>&1 || { cat "$d/gpu.out"; fail "a short run on this GPU failed"; }
  echo "cuda_compat: $(sed -n 2p "$d/version.out"); a short run on GPU 0 trains"
  exit 0
fi

refused old "compute capability 7.5; ferry's kernels need 8.0 or newer" FY_EMU_CC=7.5 -- "${run[@]}"
refused old_eval "8.0 or newer" FY_EMU_CC=7.5 -- eval --model "$d/hs128" --device cuda --batches 1 --batch 2 --seq 32
refused old_probe "8.0 or newer" FY_EMU_CC=7.5 -- probe --device cuda --probe-file "$d/probe.json"
refused no_image "cannot run this build's kernels .*-Dgpu_arch=90" FY_EMU_NO_IMAGE=1 -- "${run[@]}"
refused old_driver "NVIDIA driver supports CUDA 12.4, older than this build's CUDA" FY_EMU_OLD_DRIVER=1 -- "${run[@]}"
refused no_driver "no NVIDIA driver here" FY_EMU_NO_DRIVER=1 -- "${run[@]}"
# (ferry probe --device cuda without a GPU measures this CPU instead, and says why there was none)
FY_EMU_OLD_DRIVER=1 "$ferry" probe --device cuda --no-write --probe-file "$d/probe.json" >"$d/old_probe.out" 2>&1 ||
  { cat "$d/old_probe.out"; fail "ferry probe --device cuda without a usable GPU failed"; }
grep -q "probe on the GPU: the NVIDIA driver supports CUDA 12.4, older .*this CPU's" "$d/old_probe.out" ||
  { cat "$d/old_probe.out"; fail "ferry probe --device cuda did not say why it measured no GPU"; }
refused hidden "CUDA_VISIBLE_DEVICES='' hides every GPU" CUDA_VISIBLE_DEVICES= -- "${run[@]}"
# fp32 heads of 128 take 146 KiB a block: refused on 99 KiB (sm_89), trained on 163 KiB (sm_80).
ada=(FY_EMU_CC=8.9 FY_EMU_OPTIN_SMEM=101376)
refused fp32_ada "fp32 attention with head size 128 takes 146.0 KiB .* allows 99.0 KiB: use bf16" "${ada[@]}" -- \
  "${run[@]}" --precision fp32
refused fp32_ada_offload "allows 99.0 KiB: use bf16" "${ada[@]}" -- "${run[@]}" --precision fp32 --offload
refused fp32_ada_eval "allows 99.0 KiB: use bf16" "${ada[@]}" -- \
  eval --model "$d/hs128" --device cuda --precision fp32 --batches 1 --batch 2 --seq 32
env FY_EMU_CC=8.0 FY_EMU_OPTIN_SMEM=166912 "$ferry" "${run[@]}" --precision fp32 --log "$d/fp32_a100.jsonl" \
  >"$d/fp32_a100.out" 2>&1 || { cat "$d/fp32_a100.out"; fail "fp32 heads of 128 on 163 KiB (sm_80) did not train"; }
# bf16 on 99 KiB: the same kernels as on 227 KiB, so the same losses to the bit (basic, and narrow:
# the default, which for heads of 128 is the pipelined shape).
for v in basic narrow; do
  FERRY_CUDA_ATTENTION=$v "$ferry" "${run[@]}" --log "$d/bf16_$v.jsonl" >"$d/bf16_$v.out" 2>&1 ||
    { cat "$d/bf16_$v.out"; fail "bf16 ($v) on the emulated H100 failed"; }
  env "${ada[@]}" FERRY_CUDA_ATTENTION=$v "$ferry" "${run[@]}" --log "$d/bf16_ada_$v.jsonl" >"$d/bf16_ada_$v.out" 2>&1 ||
    { cat "$d/bf16_ada_$v.out"; fail "bf16 ($v) heads of 128 on 99 KiB did not train"; }
  a="$(losses "$d/bf16_$v.jsonl")" b="$(losses "$d/bf16_ada_$v.jsonl")"
  [ -n "$a" ] && [ "$a" = "$b" ] || fail "bf16 ($v) losses on 227 and 99 KiB differ: $a | $b"
  echo "bf16 ($v) heads of 128 on 99 KiB of shared memory: losses $b, as on 227 KiB"
done
echo "cuda_compat: every check holds"
