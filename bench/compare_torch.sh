#!/usr/bin/env bash
# ferry's bench/cpu_train against PyTorch's OPTForCausalLM (bench/peers/torch_opt.py) on the same
# model, batch and thread count, alternating runs so that drift of the shared machine hits both;
# prints every run's JSON line, then one line with the medians and ratios (also per pair of runs),
# and both model FLOP rates against the machine's fp32 multiply-add peak (bench/cpu_train).
# usage: bench/compare_torch.sh [runs=3] [build dir=build] [precision=fp32|bf16] [model=opt-125m]
#                               [batch=4] [seq=128]
# (bf16: ferry's --precision bf16 against PyTorch's autocast to bf16 over fp32 weights; model: an OPT
# preset both sides know: opt-125m, opt-350m, opt-1.3b, opt-2.7b, opt-6.7b)
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
shape=(--model "$model" --batch "$batch" --seq "$seq")
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
for i in $(seq "$runs"); do
  "$build/bench/cpu_train" "${shape[@]}" --steps 6 --threads 2 --precision "$precision" | tee -a "$out"
  python3 bench/peers/torch_opt.py "${shape[@]}" --steps 6 --threads 2 --dtype "$precision" | tee -a "$out"
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ferry = [r for r in rows if r.get("bench") == "cpu_train"]
torch = [r for r in rows if r.get("peer") == "torch"]
gemm = [r for r in rows if r.get("bench") == "gemm_fp32"]
mem = [r for r in rows if r.get("bench") == "memory"]
peak = [r for r in rows if r.get("bench") == "fma_peak_fp32"]
f_tok = statistics.median(r["tokens_per_s"] for r in ferry)
t_tok = statistics.median(r["tokens_per_s"] for r in torch)
f_gf = statistics.median(r["gflops"] for r in ferry)
t_gf = statistics.median(r["gflops"] for r in torch)
g_gf = statistics.median(r["gflops"] for r in gemm)
p_gf = statistics.median(r["gflops"] for r in peak)
# Each run of ferry against the torch run right after it: the pairs share the machine's mood.
pairs = [f["tokens_per_s"] / t["tokens_per_s"] for f, t in zip(ferry, torch)]
print(json.dumps({"compare": "ferry_vs_torch", "precision": ferry[0].get("precision", "fp32"), "runs": len(ferry),
                  "model": torch[0]["model"], "batch": torch[0]["batch"], "seq": torch[0]["seq"],
                  "ferry_tokens_per_s": round(f_tok, 1), "torch_tokens_per_s": round(t_tok, 1),
                  "speedup": round(f_tok / t_tok, 3),
                  "speedup_pairs": [round(x, 3) for x in pairs],
                  "speedup_pairs_median": round(statistics.median(pairs), 3),
                  "ferry_gflops": round(f_gf, 1), "torch_gflops": round(t_gf, 1),
                  "gemm_gflops": round(g_gf, 1), "model_rate_over_gemm": round(f_gf / g_gf, 3),
                  "fma_peak_gflops": round(p_gf, 1), "ferry_over_peak": round(f_gf / p_gf, 3),
                  "torch_over_peak": round(t_gf / p_gf, 3),
                  "peak_over_needed": round(statistics.median(r["peak_over_needed"] for r in mem), 3),
                  "torch_peak_rss_mib": round(statistics.median(r["peak_rss_mib"] for r in torch), 1)}))
PY
