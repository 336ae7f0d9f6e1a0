#!/usr/bin/env bash
# ferry's bench/cpu_train against PyTorch's OPTForCausalLM (bench/peers/torch_opt.py) on the same
# model, batch, thread count and tokens (one shard of random tokens that both take in order, the same
# windows at the same steps), runs alternating ferry, torch, ferry, torch, ... so that drift of the
# shared machine hits both; prints every run's JSON line, then one line with the ratio of the
# medians (and each pair's), and both model FLOP rates against the GEMM library's rate and the
# machine's fp32 FMA peak (bench/cpu_train). The two sides' FLOP counts must agree (PaLM's and
# Megatron's count, with llm.c's beside it: core/opt.c), or the script fails.
# usage: bench/compare_torch.sh [runs=3] [build dir=build] [precision=fp32|bf16] [model=opt-125m]
#                               [batch=4] [seq=128]
# (runs: of each side; bf16: ferry's --precision bf16 against PyTorch's autocast to bf16 over fp32
# weights; model: an OPT preset both sides know: opt-125m, opt-350m, opt-1.3b, opt-2.7b, opt-6.7b.
# The default configuration is `bench/compare_torch.sh` alone: opt-125m, fp32, 4 x 128, 2 threads,
# 3 runs of each.)
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}" build="${2:-build}" precision="${3:-fp32}" model="${4:-opt-125m}" batch="${5:-4}" seq="${6:-128}"
case "$precision" in fp32|bf16) ;; *) echo "compare_torch.sh: precision is fp32 or bf16" >&2; exit 2 ;; esac
case "$model" in opt-125m|opt-350m|opt-1.3b|opt-2.7b|opt-6.7b) ;;
  *) echo "compare_torch.sh: model is one of opt-125m, opt-350m, opt-1.3b, opt-2.7b, opt-6.7b" >&2; exit 2 ;;
esac
for v in "$runs" "$batch" "$seq"; do
  case "$v" in ''|*[!0-9]*|0) echo "compare_torch.sh: runs, batch and seq are positive integers" >&2; exit 2 ;; esac
done
steps=6
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
out="$work/runs.jsonl" shard="$work/tokens.bin"
# The tokens: random ids below OPT's vocabulary (50272), enough windows for every step, in llm.c's
# shard format (runtime/data.h).
python3 - "$shard" $((batch * (seq + 1) * (steps + 2) + 1)) <<'PY'
import random, struct, sys
path, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(1234)
with open(path, "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
    f.write(struct.pack(f"<{n}H", *(rng.randrange(50272) for _ in range(n))))
PY
shape=(--model "$model" --batch "$batch" --seq "$seq" --steps "$steps" --threads 2 --data "$shard")
for i in $(seq "$runs"); do
  "$build/bench/cpu_train" "${shape[@]}" --precision "$precision" | tee -a "$out"
  python3 bench/peers/torch_opt.py "${shape[@]}" --dtype "$precision" --compile no | tee -a "$out"
done
python3 - "$out" "$runs" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ferry = [r for r in rows if r.get("bench") == "cpu_train"]
torch = [r for r in rows if r.get("peer") == "torch"]
gemm = [r for r in rows if r.get("bench") == "gemm_fp32"]
mem = [r for r in rows if r.get("bench") == "memory"]
peak = [r for r in rows if r.get("bench") == "fma_peak_fp32"]
if len(ferry) != int(sys.argv[2]) or len(torch) != len(ferry):
    sys.exit(f"compare_torch.sh: {len(ferry)} ferry and {len(torch)} torch runs, {sys.argv[2]} of each wanted")
for key in ("flops_per_step", "flops_per_step_llmc"):
    if abs(ferry[0][key] - torch[0][key]) > 1e-9 * ferry[0][key]:
        sys.exit(f"compare_torch.sh: the two sides count {key} differently: ferry {ferry[0][key]:.6g}, "
                 f"torch {torch[0][key]:.6g}")
med = lambda rs, k: statistics.median(r[k] for r in rs)
f_tok, t_tok = med(ferry, "tokens_per_s"), med(torch, "tokens_per_s")
f_gf, t_gf, g_gf, p_gf = med(ferry, "gflops"), med(torch, "gflops"), med(gemm, "gflops"), med(peak, "gflops")
# Each run of ferry against the torch run right after it: the pairs share the machine's mood.
pairs = [f["tokens_per_s"] / t["tokens_per_s"] for f, t in zip(ferry, torch)]
print(json.dumps({"compare": "ferry_vs_torch", "precision": ferry[0].get("precision", "fp32"), "runs": len(ferry),
                  "model": torch[0]["model"], "batch": torch[0]["batch"], "seq": torch[0]["seq"],
                  "torch_adamw": torch[0]["adamw"], "flops_count": "palm",
                  "ferry_tokens_per_s": round(f_tok, 1), "torch_tokens_per_s": round(t_tok, 1),
                  "speedup": round(f_tok / t_tok, 3),
                  "speedup_pairs": [round(x, 3) for x in pairs],
                  "speedup_pairs_median": round(statistics.median(pairs), 3),
                  "ferry_gflops": round(f_gf, 1), "torch_gflops": round(t_gf, 1),
                  "ferry_gflops_llmc": round(med(ferry, "gflops_llmc"), 1),
                  "torch_gflops_llmc": round(med(torch, "gflops_llmc"), 1),
                  "gemm_gflops": round(g_gf, 1), "model_rate_over_gemm": round(f_gf / g_gf, 3),
                  "fma_peak_gflops": round(p_gf, 1), "fma_isa": peak[0].get("isa"),
                  "gemm_over_peak": round(g_gf / p_gf, 3), "ferry_over_peak": round(f_gf / p_gf, 3),
                  "torch_over_peak": round(t_gf / p_gf, 3),
                  "ferry_loss_last": round(med(ferry, "loss_last"), 4), "torch_loss_last": round(med(torch, "loss_last"), 4),
                  "peak_over_needed": round(med(mem, "peak_over_needed"), 3),
                  "torch_peak_rss_mib": round(med(torch, "peak_rss_mib"), 1)}))
PY
