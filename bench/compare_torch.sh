#!/usr/bin/env bash
# ferry's bench/cpu_train against PyTorch's OPTForCausalLM (bench/peers/torch_opt.py) on the same
# model, batch and thread count, alternating runs so that drift of the shared machine hits both;
# prints every run's JSON line, then one line with the medians and ratios.
# usage: bench/compare_torch.sh [runs=3] [build dir=build]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}" build="${2:-build}"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
for i in $(seq "$runs"); do
  "$build/bench/cpu_train" --steps 6 --threads 2 | tee -a "$out"
  python3 bench/peers/torch_opt.py --steps 6 --threads 2 | tee -a "$out"
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ferry = [r for r in rows if r.get("bench") == "cpu_train"]
torch = [r for r in rows if r.get("peer") == "torch"]
gemm = [r for r in rows if r.get("bench") == "gemm_fp32"]
mem = [r for r in rows if r.get("bench") == "memory"]
f_tok = statistics.median(r["tokens_per_s"] for r in ferry)
t_tok = statistics.median(r["tokens_per_s"] for r in torch)
f_gf = statistics.median(r["gflops"] for r in ferry)
g_gf = statistics.median(r["gflops"] for r in gemm)
print(json.dumps({"compare": "ferry_vs_torch", "runs": len(ferry),
                  "ferry_tokens_per_s": round(f_tok, 1), "torch_tokens_per_s": round(t_tok, 1),
                  "speedup": round(f_tok / t_tok, 3), "ferry_gflops": round(f_gf, 1),
                  "gemm_gflops": round(g_gf, 1), "model_rate_over_gemm": round(f_gf / g_gf, 3),
                  "peak_over_needed": round(statistics.median(r["peak_over_needed"] for r in mem), 3),
                  "torch_peak_rss_mib": round(statistics.median(r["peak_rss_mib"] for r in torch), 1)}))
PY
