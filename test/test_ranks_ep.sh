#!/usr/bin/env bash
# Expert parallelism under mpirun (--ep, runtime/ep.h) on opt-moe-tiny (4 experts a mixture layer)
# against 1 rank accumulating the same micro-batches (the same global batch): ep 2 (2 experts a
# rank) gives its weights bit for bit without gradient clipping (each source's rows for an expert
# are one product, as on one rank, and the sources' gradients add in rank order); ep 4 (1 expert a
# rank) and 4 ranks as 2 groups of ep 2 with clipping (the norm adds the experts' parts in another
# order) within 1e-5; an ep 2 checkpoint resumes on 1 rank and a 1-rank one under ep 2, bit for
# bit; experts that get no token (routing forced onto two experts of one rank; with --recompute)
# train in step with 1 rank, without a hang; bf16 and fp16 compute and bf16 and 8-bit AdamW state
# against 1 rank in the same numbers (and their checkpoints); ep 2 x tp 2 against the tp grid and
# 1 rank; ep 2 within pp 2 stages against the pp grid and 1 rank; layouts that do not fit are
# refused, naming the numbers.
# usage: test/test_ranks_ep.sh path/to/ferry            (exit 77 = skipped: no mpirun)
set -u
ferry="$1"
command -v mpirun >/dev/null 2>&1 || { echo "skipped: mpirun is not installed"; exit 77; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mpi=(env ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0" mpirun --allow-run-as-root --oversubscribe -x ASAN_OPTIONS)
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok    $1"; }
bad() { fail=$((fail + 1)); echo "FAIL  $1"; }

python3 - "$tmp/data.bin" <<'PY'
import random, struct, sys
random.seed(5)
n = 20000
t = [(i * 7 + random.randrange(3)) % 97 for i in range(n)]
open(sys.argv[1], "wb").write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)) + struct.pack("<%dH" % n, *t))
PY
# compare REF RUN TOL [WTOL]: the losses and aux_losses of RUN.json (the last steps of REF.json's)
# within TOL relative, the saved weights within WTOL (default TOL) normalised error; WTOL 0: the
# same bytes. (Bit-for-bit runs still print losses 1e-6 apart: the ranks sum their losses in fp32.)
compare() {
  python3 - "$tmp" "$1" "$2" "$3" "${4:-$3}" <<'PY'
import json, struct, sys
d, a, b, tol, wtol = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
la = {r["step"]: (r["loss"], r["aux_loss"]) for r in map(json.loads, open("%s/%s.json" % (d, a)))}
lb = {r["step"]: (r["loss"], r["aux_loss"]) for r in map(json.loads, open("%s/%s.json" % (d, b)))}
assert sorted(lb) == sorted(la)[-len(lb):] and lb, (sorted(la), sorted(lb))
for s in lb:
    for x, y in zip(la[s], lb[s]):
        assert abs(x - y) <= tol * abs(x), (s, la[s], lb[s])
ra, rb = (open("%s/%s/model.safetensors" % (d, x), "rb").read() for x in (a, b))
def tensors(raw):
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    return {k: struct.unpack("<%df" % ((v["data_offsets"][1] - v["data_offsets"][0]) // 4),
                             raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in hdr.items() if k != "__metadata__"}
x, y = tensors(ra), tensors(rb)
assert x.keys() == y.keys() and all(len(x[k]) == len(y[k]) for k in x)
err = (sum((p - q) ** 2 for k in x for p, q in zip(x[k], y[k])) / sum(p * p for k in x for p in x[k])) ** 0.5
assert err <= wtol, err
if wtol == 0: assert ra == rb
print("  %s vs %s: %d losses and aux_losses within %g, weights %s" % (a, b, len(lb), tol,
      "the same bytes" if wtol == 0 else "within %.2g" % err))
PY
}
common=(--model opt-moe-tiny --data "$tmp/data.bin" --seq 32 --batch 2 --steps 6 --threads 1 --quiet --comm-timeout 30)
run() {  # run NAME RANKS [options...]: 1 rank accumulating RANKS micro-batches, or RANKS ranks
  local name="$1" n="$2"; shift 2
  if [ "$n" = 1 ]; then "$ferry" train "${common[@]}" --log "$tmp/$name.json" --save "$tmp/$name" "$@" >"$tmp/$name.out" 2>&1
  else "${mpi[@]}" -np "$n" "$ferry" train "${common[@]}" --log "$tmp/$name.json" --save "$tmp/$name" "$@" >"$tmp/$name.out" 2>&1
  fi || { bad "$name trains"; cat "$tmp/$name.out"; }
}

run one2 1 --grad-accum 2 --clip 0
run ep2 2 --ep 2 --clip 0
compare one2 ep2 1e-6 0 && ok "ep 2 (2 experts a rank): 1 rank's weights bit for bit (no clipping)" || bad "ep 2 differs from 1 rank"
run one4 1 --grad-accum 4
run ep4 4 --ep 4
compare one4 ep4 1e-5 && ok "ep 4 (1 expert a rank) within 1e-5 of 1 rank (gradient clipping on)" || bad "ep 4 differs from 1 rank"
run dp2ep2 4 --ep 2
compare one4 dp2ep2 1e-5 && ok "4 ranks as 2 groups of ep 2 (experts' gradients summed over the replicas) within 1e-5 of 1 rank" \
  || bad "2 groups of ep 2 differ from 1 rank"
# Each rank holds its experts alone: the model state of ep 4 is smaller than 1 rank's.
python3 - "$tmp/one4.json" "$tmp/ep4.json" <<'PY' && ok "ep 4 holds less state than 1 rank" || bad "ep 4's state"
import json, sys
one, ep = (json.loads(open(p).readline())["device_peak_mib"] for p in sys.argv[1:])
assert ep < one, (one, ep)
print("  device peak %.3f MiB on 1 rank, %.3f MiB on each rank of ep 4" % (one, ep))
PY

# Checkpoints stay layout-free: ep 2 stops after 4 steps, 1 rank resumes; 1 rank stops, ep 2 resumes.
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --clip 0 --ep 2 --save "$tmp/ck_ep" --save-every 100 --stop-after 3 \
  >"$tmp/ck_ep.out" 2>&1 || { bad "ep 2 checkpoints"; cat "$tmp/ck_ep.out"; }
run res1 1 --grad-accum 2 --clip 0 --resume "$tmp/ck_ep"
compare one2 res1 1e-6 0 && ok "an ep 2 checkpoint resumes on 1 rank bit for bit" || bad "ep 2 -> 1 rank resume differs"
"$ferry" train "${common[@]}" --clip 0 --grad-accum 2 --save "$tmp/ck_one" --save-every 100 --stop-after 3 \
  >"$tmp/ck_one.out" 2>&1 || { bad "1 rank checkpoints"; cat "$tmp/ck_one.out"; }
run res2 2 --ep 2 --clip 0 --resume "$tmp/ck_one"
compare one2 res2 1e-6 0 && ok "a 1-rank checkpoint resumes under ep 2 bit for bit" || bad "1 rank -> ep 2 resume differs"

# Starved experts: layer 1's and 3's final_layer_norm weight 0 and a gate that prefers experts 2 and
# 3 for its bias make every token choose experts 2 and 3 (both on rank 1 under ep 2): rank 0's
# experts get no row, rank 0 sends all of its rows away, and every gradient is still summed.
python3 - "$tmp/one2/model.safetensors" "$tmp/starve" <<'PY'
import json, os, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr = json.loads(raw[8:8 + n])
data = bytearray(raw[8 + n:])
def put(name, values):
    a, b = hdr[name]["data_offsets"]
    assert (b - a) // 4 == len(values)
    data[a:b] = struct.pack("<%df" % len(values), *values)
for l in (1, 3):
    C = hdr["model.decoder.layers.%d.final_layer_norm.weight" % l]["shape"][0]
    put("model.decoder.layers.%d.final_layer_norm.weight" % l, [0.0] * C)
    put("model.decoder.layers.%d.final_layer_norm.bias" % l, [1.0] * C)
    put("model.decoder.layers.%d.block_sparse_moe.gate.weight" % l, sum(([c / C] * C for c in (-3, -3, 3, 2)), []))
os.makedirs(sys.argv[2])
open(os.path.join(sys.argv[2], "model.safetensors"), "wb").write(raw[:8 + n] + bytes(data))
cfg = os.path.join(os.path.dirname(sys.argv[1]), "config.json")
open(os.path.join(sys.argv[2], "config.json"), "w").write(open(cfg).read())
PY
run starve1 1 --grad-accum 2 --clip 0 --init "$tmp/starve"
run starve2 2 --ep 2 --clip 0 --init "$tmp/starve" --recompute  # (recomputed forwards move the rows again)
compare starve1 starve2 1e-6 0 && ok "experts that get no token (and --recompute): ep 2 finishes, bit for bit 1 rank's run" || bad "starved experts under ep 2"
python3 - "$tmp/starve/model.safetensors" "$tmp/starve2/model.safetensors" <<'PY' && ok "the starved experts' fc1 moved by weight decay alone" || bad "the starved experts"
import json, struct, sys
def t(path, name):
    raw = open(path, "rb").read(); n = struct.unpack("<Q", raw[:8])[0]; h = json.loads(raw[8:8 + n])[name]
    a, b = h["data_offsets"]; return h["shape"], struct.unpack("<%df" % ((b - a) // 4), raw[8 + n + a:8 + n + b])
name = "model.decoder.layers.1.block_sparse_moe.experts.fc1.weight"
(shape, w0), (_, w1) = t(sys.argv[1], name), t(sys.argv[2], name)
half = len(w0) // 2  # experts 0 and 1 (rank 0's): the first half of the stacked rows
r = [b / a for a, b in zip(w0[:half], w1[:half]) if abs(a) > 1e-3]
assert r and max(r) - min(r) < 1e-5 and max(r) < 1, (min(r), max(r))  # one factor (1 - lr wd) a step for all
assert any(abs(a - b) > 1e-3 * abs(a) for a, b in zip(w0[half:], w1[half:]))  # the chosen ones trained
PY

# Offloaded (--device sim, AdamW's state of 4 chunks on the disk tier): every chunk sharded across
# the data-parallel ranks (zero), a mixture's rows moved to the ranks computing its experts inside
# the engine's op call. ep 2 gives 1 rank's (and ep 2 on the cpu's) weights bit for bit; 2 groups of
# ep 2 within 1e-5 (clipping); its checkpoint resumes on 1 rank and a 1-rank one under it, bit for
# bit; starved experts (rank 0's get no row; --recompute; it loads none of them) still have their
# gradients reduced (the chunks' reduce-scatter).
sim=(--device sim --blocks 4 --prefetch 2 --disk-chunks 4)
run sep2 2 --ep 2 --clip 0 "${sim[@]}" --disk-dir "$tmp/d_sep2"
compare one2 sep2 1e-6 0 && compare ep2 sep2 1e-6 0 && ok "ep 2 on sim, sharded, disk tier: 1 rank's and ep 2 on the cpu's weights bit for bit" \
  || bad "ep 2 on sim differs"
run sdp2ep2 4 --ep 2 "${sim[@]}" --disk-dir "$tmp/d_sdp2ep2"
compare one4 sdp2ep2 1e-5 && compare dp2ep2 sdp2ep2 1e-5 && ok "4 sim ranks as 2 groups of ep 2 within 1e-5 of 1 rank and of the cpu's" \
  || bad "2 groups of ep 2 on sim differ"
# A rank loads its own experts alone, those that got rows (runtime/offload.c, "expert parallelism
# over sharded chunks"): the log's expert chunks loaded are at most half of those its loads of the
# mixtures' chunks hold (here every expert gets rows: half), every step.
python3 - "$tmp/sep2.json" "$tmp/sdp2ep2.json" <<'PY' && ok "ep 2 on sim loads half of the experts (the log's expert chunks)" \
  || bad "the expert chunks ep 2 on sim loads"
import json, sys
for f in sys.argv[1:]:
    rs = [json.loads(l) for l in open(f)]
    assert rs and all(r["expert_chunks"] > 0 and 2 * r["expert_chunks_loaded"] == r["expert_chunks"] for r in rs), \
        [(r.get("expert_chunks_loaded"), r.get("expert_chunks")) for r in rs]
PY
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --clip 0 --ep 2 "${sim[@]}" --disk-dir "$tmp/d_ck" --save "$tmp/ck_sep" \
  --save-every 100 --stop-after 3 >"$tmp/ck_sep.out" 2>&1 || { bad "ep 2 on sim checkpoints"; cat "$tmp/ck_sep.out"; }
run sres1 1 --grad-accum 2 --clip 0 --resume "$tmp/ck_sep"
compare one2 sres1 1e-6 0 && ok "an ep 2 checkpoint from sim resumes on 1 rank bit for bit" || bad "ep 2 on sim -> 1 rank resume differs"
run sres2 2 --ep 2 --clip 0 "${sim[@]}" --disk-dir "$tmp/d_res2" --resume "$tmp/ck_one"
compare one2 sres2 1e-6 0 && ok "a 1-rank checkpoint resumes under ep 2 on sim bit for bit" || bad "1 rank -> ep 2 on sim resume differs"
run sstarve2 2 --ep 2 --clip 0 --init "$tmp/starve" --recompute "${sim[@]}" --disk-dir "$tmp/d_starve"
compare starve1 sstarve2 1e-6 0 && ok "experts that get no token on sim (and --recompute): bit for bit 1 rank's run" \
  || bad "starved experts under ep 2 on sim"
# Rank 0's experts get no row: it loads none of them (the log is rank 0's), and its blocks' ranges
# of them, never loaded, are never read (the bits above).
python3 - "$tmp/sstarve2.json" <<'PY' && ok "a rank whose experts get no row loads none of them (sim)" || bad "starved experts loaded"
import json, sys
rs = [json.loads(l) for l in open(sys.argv[1])]
assert rs and all(r["expert_chunks"] > 0 and r["expert_chunks_loaded"] == 0 for r in rs), \
    [(r.get("expert_chunks_loaded"), r.get("expert_chunks")) for r in rs]
PY
# Without --ep, 2 sharded sim ranks load the experts their own tokens chose, the same way (every rank
# one ep rank holding every expert; the reduce-scatter stays whole): here experts 2 and 3, half of
# them; bit for bit 1 rank's run.
run szero2 2 --clip 0 --init "$tmp/starve" --recompute "${sim[@]}" --disk-dir "$tmp/d_szero2"
compare starve1 szero2 1e-6 0 && python3 - "$tmp/szero2.json" <<'PY' \
  && ok "2 sharded sim ranks without --ep load the experts that got tokens, bit for bit 1 rank's run" || bad "2 sharded sim ranks' experts"
import json, sys
rs = [json.loads(l) for l in open(sys.argv[1])]
assert rs and all(r["expert_chunks"] > 0 and 2 * r["expert_chunks_loaded"] == r["expert_chunks"] for r in rs), \
    [(r.get("expert_chunks_loaded"), r.get("expert_chunks")) for r in rs]
PY

# 16-bit compute and compressed AdamW state, 3 steps each (docs/ranks.md, "16-bit numerics and
# compressed AdamW state"). --precision bf16 and fp16: the pieces compute the whole op's 16-bit
# products on its fp32 rows, and each source's part of an expert's gradient is rounded as that
# source's own backward rounds it before the sources add: 1 rank's weights bit for bit, on the cpu
# and on sim. --optimizer-state bf16 (element by element): 1 rank's bits. 8bit: on the cpu a rank
# quantises the blocks of its own experts' flat layout; opt-moe-tiny's experts' slices (C 32) are
# not whole blocks, so a block of 1 rank's that holds two ranks' experts is two blocks here: within
# the tolerance of test_ranks.sh's bf16 ranks against 1 bf16 rank (losses 1e-4, weights 5e-3); its
# checkpoint is 1 rank's file (the same tensors and metadata), written from m and v read back, and
# resumes on 1 rank (and a 1-rank one under ep 2) re-quantised. With slices of whole blocks (a model
# 256 wide) 1 rank's bits and checkpoint bytes. On sim (the graph keeps every expert, its chunks
# sharded as the dense ones) 1 rank's bits, and its checkpoint holds 1 rank's bytes.
q=(--steps 3 --clip 0)
for p in bf16 fp16; do
  run one2p$p 1 --grad-accum 2 "${q[@]}" --precision $p
  run ep2p$p 2 --ep 2 "${q[@]}" --precision $p
  compare one2p$p ep2p$p 1e-6 0 && ok "ep 2 in $p: 1 $p rank's weights bit for bit" || bad "ep 2 in $p differs from 1 rank"
done
run sep2pbf16 2 --ep 2 "${q[@]}" --precision bf16 "${sim[@]}" --disk-dir "$tmp/d_sep2p"
compare one2pbf16 sep2pbf16 1e-6 0 && ok "ep 2 in bf16 on sim: 1 bf16 rank's weights bit for bit" || bad "ep 2 in bf16 on sim differs"
# stateq NAME RANKS [options...]: a 3-step run with 8-bit state that also checkpoints after step 2
# (NAME.d/step-00000002; NAME: its last checkpoint, the final weights)
stateq() {
  local name="$1" n="$2"; shift 2
  run "$name" "$n" "${q[@]}" --optimizer-state 8bit --save "$tmp/$name.d" --save-every 2 "$@"
  ln -sfn "$tmp/$name.d/step-00000003" "$tmp/$name"
}
run one2sbf16 1 --grad-accum 2 "${q[@]}" --optimizer-state bf16
run ep2sbf16 2 --ep 2 "${q[@]}" --optimizer-state bf16
compare one2sbf16 ep2sbf16 1e-6 0 && ok "ep 2 with bf16 AdamW state: 1 rank's weights bit for bit" || bad "ep 2 with bf16 state differs"
stateq one2s8bit 1 --grad-accum 2
stateq ep2s8bit 2 --ep 2
compare one2s8bit ep2s8bit 1e-4 5e-3 && ok "ep 2 with 8-bit AdamW state within 1e-4 and 5e-3 of 1 rank (experts' slices not whole blocks: its own blocks)" \
  || bad "ep 2 with 8-bit state drifts from 1 rank"
run q8res1 1 --grad-accum 2 "${q[@]}" --optimizer-state 8bit --resume "$tmp/ep2s8bit.d/step-00000002"
run q8res2 2 --ep 2 "${q[@]}" --optimizer-state 8bit --resume "$tmp/one2s8bit.d/step-00000002"
python3 - "$tmp/one2s8bit.d/step-00000002" "$tmp/ep2s8bit.d/step-00000002" <<'PY' && compare ep2s8bit q8res1 1e-5 1e-3 \
  && compare one2s8bit q8res2 1e-5 1e-3 && ok "an ep 2 checkpoint with 8-bit state is 1 rank's file, resumes on 1 rank, and a 1-rank one under ep 2" \
  || bad "8-bit checkpoints across ep 2 and 1 rank"
import json, struct, sys
def header(d):
    raw = open(d + "/optimizer.safetensors", "rb").read()
    return json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
a, b = header(sys.argv[1]), header(sys.argv[2])
assert a == b and a["__metadata__"]["optimizer_state"] == "8bit", "the ep 2 file's tensors are not 1 rank's"
assert any(k.startswith("exp_avg_absmax.") and "experts" in k for k in a)
print("  optimizer.safetensors: %d tensors, 1 rank's names, dtypes, shapes and block offsets" % (len(a) - 1))
PY
# A model whose experts' slices are whole blocks (hidden and ffn sizes multiples of 256, as
# opt-125m-moe8's): a rank's 8-bit blocks are 1 rank's, so the run and its checkpoint are 1 rank's bits.
mkdir -p "$tmp/cfg-wide"
python3 - "$tmp/cfg-wide/config.json" <<'PY'
import json, sys
json.dump({"model_type": "opt", "vocab_size": 97, "hidden_size": 256, "word_embed_proj_dim": 256, "ffn_dim": 256,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
           "do_layer_norm_before": True, "activation_function": "relu", "pad_token_id": 1, "dropout": 0.0,
           "num_local_experts": 4, "num_experts_per_tok": 2, "moe_layer_frequency": 2}, open(sys.argv[1], "w"))
PY
# same_ckpt A B: 1 when A's and B's step-2 checkpoints hold the same model and optimizer bytes, else 0.
same_ckpt() {
  local f
  for f in model.safetensors optimizer.safetensors; do
    cmp -s "$tmp/$1.d/step-00000002/$f" "$tmp/$2.d/step-00000002/$f" || { echo 0; return; }
  done
  echo 1
}
stateq wide1 1 --grad-accum 2 --model "$tmp/cfg-wide"
stateq wide2 2 --ep 2 --model "$tmp/cfg-wide"
same=$(same_ckpt wide1 wide2)
compare wide1 wide2 1e-6 0 && [ $same = 1 ] \
  && ok "experts' slices of whole 8-bit blocks: ep 2 on the cpu gives 1 rank's weights bit for bit, its checkpoint 1 rank's bytes" \
  || bad "ep 2 with 8-bit state of whole blocks differs from 1 rank (checkpoint the same bytes: $same)"
stateq sep2s8bit 2 --ep 2 "${sim[@]}" --disk-dir "$tmp/d_sep2s"
same=$(same_ckpt one2s8bit sep2s8bit)
compare one2s8bit sep2s8bit 1e-6 0 && [ $same = 1 ] \
  && ok "ep 2 with 8-bit AdamW state on sim: 1 rank's weights bit for bit, and its checkpoint 1 rank's bytes" \
  || bad "ep 2 with 8-bit state on sim differs (checkpoint the same bytes: $same)"

# The planner's expert parallelism (planner/plan.c, ep_sizes): ferry plan of the mixture on 2 sim
# ranks searches ep 1 and 2; its plan file with "ep": 2 (and one micro-batch of 2 sequences a rank)
# runs under mpirun as --ep 2 does: 1 rank's weights bit for bit. An ep that does not divide dp is
# refused when the file is read.
"$ferry" plan --model opt-moe-tiny --batch 4 --seq 32 --gpus 2 --device sim --device-mem 4MiB --out "$tmp/planep.json" \
  >"$tmp/planep.out" 2>&1 && grep -q "^  2 ranks: 2 data-parallel (zero)" "$tmp/planep.out" \
  && ok "ferry plan --gpus 2 of a mixture on sim lays out 2 data-parallel ranks" || { bad "ferry plan of a mixture"; cat "$tmp/planep.out"; }
python3 - "$tmp/planep.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
p.update(micro_batch=2, grad_accum=1, seq=32, ep=2)
json.dump(p, open(sys.argv[1], "w"))
p["ep"] = 3
json.dump(p, open(sys.argv[1] + ".bad", "w"))
PY
loud=()
for a in "${common[@]}"; do [ "$a" = --quiet ] || loud+=("$a"); done
"${mpi[@]}" -np 2 "$ferry" train "${loud[@]}" --clip 0 --device-mem 4MiB --plan "$tmp/planep.json" --log "$tmp/planrun.json" \
  --save "$tmp/planrun" >"$tmp/planrun.out" 2>&1 || { bad "2 ranks run the plan with ep 2"; cat "$tmp/planrun.out"; }
grep -q "expert parallelism: ep 2" "$tmp/planrun.out" && compare one2 planrun 1e-6 0 \
  && ok "a plan file with ep 2 runs expert-parallel on 2 sim ranks: 1 rank's weights bit for bit" \
  || { bad "the plan with ep 2"; tail -5 "$tmp/planrun.out"; }
out="$("${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --device-mem 4MiB --plan "$tmp/planep.json.bad" 2>&1)"
[ $? -ne 0 ] && grep -q '"ep" is 3, which does not divide "dp" 2' <<<"$out" && ok "a plan file's ep 3 on dp 2 refused" \
  || { bad "a plan file's ep 3"; echo "$out" | tail -3; }

# Expert and tensor parallelism together (docs/ranks.md, "With tensor parallelism"): 4 ranks as a
# data-parallel pair (one ep 2 group) of tp 2 pairs, each rank its tp slice of 2 experts, 3 steps.
# Against the same grid without --ep (a 2 x 2 grid of replicated tp pairs) bit for bit without
# clipping (each source's rows for an expert are one product and the sources add in rank order, as
# the replicas' all-reduce), and with clipping within 1e-5; against 1 rank accumulating the 2
# micro-batches within 1e-5 (the tp sums add the slices' parts in another order); its checkpoint
# resumes on 1 rank within 1e-5; and on sim (offloaded, the experts' tp slices in chunks sharded over the data-parallel ranks) the
# cpu's weights bit for bit.
run one2q 1 --grad-accum 2 "${q[@]}"
run tp2q 4 --tp 2 "${q[@]}"
run eptp 4 --ep 2 --tp 2 "${q[@]}"
compare tp2q eptp 1e-6 0 && compare one2q eptp 1e-5 \
  && ok "ep 2 x tp 2: the 2 x 2 tp grid's weights bit for bit, 1 rank's within 1e-5" || bad "ep 2 x tp 2 differs"
run tp2c 4 --tp 2 --steps 3
run eptpc 4 --ep 2 --tp 2 --steps 3
compare tp2c eptpc 1e-5 && ok "ep 2 x tp 2 with gradient clipping (the experts' slices' norm over ep, then tp) within 1e-5 of the tp grid" \
  || bad "ep 2 x tp 2 with clipping differs"
"${mpi[@]}" -np 4 "$ferry" train "${common[@]}" "${q[@]}" --ep 2 --tp 2 --save "$tmp/ck_eptp" --save-every 100 \
  --stop-after 2 >"$tmp/ck_eptp.out" 2>&1 || { bad "ep 2 x tp 2 checkpoints"; cat "$tmp/ck_eptp.out"; }
run eptpres1 1 --grad-accum 2 "${q[@]}" --resume "$tmp/ck_eptp"
compare one2q eptpres1 1e-5 && ok "an ep 2 x tp 2 checkpoint resumes on 1 rank" || bad "ep 2 x tp 2 -> 1 rank resume differs"
run septp 4 --ep 2 --tp 2 "${q[@]}" "${sim[@]}" --disk-dir "$tmp/d_septp"
compare eptp septp 1e-6 0 && ok "ep 2 x tp 2 on sim (sharded, disk tier): the cpu's weights bit for bit" \
  || bad "ep 2 x tp 2 on sim differs"
# A plan of 2 x tp 2 sim ranks with "ep": 2 is checked and priced, and runs as --ep 2 --tp 2 does.
"$ferry" plan --model opt-moe-tiny --batch 4 --seq 32 --gpus 4 --tp 2 --device sim --device-mem 4MiB \
  --out "$tmp/planeptp.json" >"$tmp/planeptp.out" 2>&1 || { bad "ferry plan --tp 2 of a mixture"; cat "$tmp/planeptp.out"; }
python3 -c 'import json, sys; p = json.load(open(sys.argv[1])); p["ep"] = 2; json.dump(p, open(sys.argv[1], "w"))' \
  "$tmp/planeptp.json"
"${mpi[@]}" -np 4 "$ferry" train "${loud[@]}" "${q[@]}" --device-mem 4MiB --plan "$tmp/planeptp.json" \
  --log "$tmp/planeptprun.json" --save "$tmp/planeptprun" >"$tmp/planeptprun.out" 2>&1 \
  || { bad "4 ranks run the plan with ep 2 x tp 2"; cat "$tmp/planeptprun.out"; }
grep -q "expert parallelism: ep 2" "$tmp/planeptprun.out" && compare tp2q planeptprun 1e-6 0 \
  && ok "a plan file with ep 2 and tp 2 runs on 4 sim ranks: the tp grid's weights bit for bit" \
  || { bad "the plan with ep 2 x tp 2"; tail -5 "$tmp/planeptprun.out"; }

# Expert parallelism within pipeline stages (docs/ranks.md, "Within pipeline stages"): test_ranks.sh's
# 4-layer mixture (every layer 4 experts top 2, untied: its pipelines give 1 rank's bits) on 4 ranks
# as dp 2 x pp 2 with --ep 2 (each stage's ep group its 2 data-parallel ranks, 2 experts a rank of
# each of its layers' mixtures), 3 steps. With one micro-batch a rank and no clipping: the same grid
# without --ep and 1 rank accumulating the 2 micro-batches bit for bit; with 2 micro-batches a rank
# (1F1B: a stage runs the second's forward before the first's backward, each keeping its own rows)
# and clipping, within 1e-5 of the grid without --ep; a checkpoint of it resumes on 1 rank bit for
# bit. On sim (the stages' chunks sharded over their data-parallel ranks, the graph keeping every
# expert, a disk tier) 1 rank's weights bit for bit, and its checkpoint resumes on 1 rank bit for
# bit; --device cuda with both is refused (not yet).
mkdir -p "$tmp/cfg-moe4"
python3 - "$tmp/cfg-moe4/config.json" <<'PY'
import json, sys
json.dump({"model_type": "opt", "vocab_size": 97, "hidden_size": 32, "word_embed_proj_dim": 32, "ffn_dim": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 64,
           "do_layer_norm_before": True, "activation_function": "relu", "pad_token_id": 1, "dropout": 0.0,
           "tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2,
           "moe_layer_frequency": 1, "router_aux_loss_coef": 0.01}, open(sys.argv[1], "w"))
PY
m4=(--model "$tmp/cfg-moe4" --steps 3)
run m4one 1 --grad-accum 2 "${m4[@]}" --clip 0
run m4pp 4 --pp 2 "${m4[@]}" --clip 0
run m4eppp 4 --ep 2 --pp 2 "${m4[@]}" --clip 0
compare m4one m4eppp 1e-6 0 && compare m4pp m4eppp 1e-6 0 \
  && ok "ep 2 within pp 2 stages (dp 2 x pp 2): 1 rank's and the pp grid's weights bit for bit" || bad "ep 2 x pp 2 differs"
run m4ppc 4 --pp 2 "${m4[@]}" --grad-accum 2
run m4epppc 4 --ep 2 --pp 2 "${m4[@]}" --grad-accum 2
compare m4ppc m4epppc 1e-5 && ok "ep 2 x pp 2, 2 micro-batches a rank in flight, with clipping: within 1e-5 of the pp grid" \
  || bad "ep 2 x pp 2 with 2 micro-batches differs"
"${mpi[@]}" -np 4 "$ferry" train "${common[@]}" "${m4[@]}" --clip 0 --ep 2 --pp 2 --save "$tmp/ck_eppp" --save-every 100 \
  --stop-after 2 >"$tmp/ck_eppp.out" 2>&1 || { bad "ep 2 x pp 2 checkpoints"; cat "$tmp/ck_eppp.out"; }
run m4res1 1 --grad-accum 2 "${m4[@]}" --clip 0 --resume "$tmp/ck_eppp"
compare m4one m4res1 1e-6 0 && ok "an ep 2 x pp 2 checkpoint resumes on 1 rank bit for bit" || bad "ep 2 x pp 2 -> 1 rank resume differs"
run m4seppp 4 --ep 2 --pp 2 "${m4[@]}" --clip 0 "${sim[@]}" --disk-dir "$tmp/d_m4seppp"
"${mpi[@]}" -np 4 "$ferry" train "${common[@]}" "${m4[@]}" --clip 0 --ep 2 --pp 2 "${sim[@]}" \
  --disk-dir "$tmp/d_ck_seppp" --save "$tmp/ck_seppp" --save-every 100 --stop-after 2 >"$tmp/ck_seppp.out" 2>&1 \
  || { bad "ep 2 x pp 2 on sim checkpoints"; cat "$tmp/ck_seppp.out"; }
run m4sres1 1 --grad-accum 2 "${m4[@]}" --clip 0 --resume "$tmp/ck_seppp"
compare m4one m4seppp 1e-6 0 && compare m4one m4sres1 1e-6 0 \
  && ok "ep 2 x pp 2 on sim (sharded, disk tier): 1 rank's weights bit for bit; its checkpoint resumes on 1 rank bit for bit" \
  || bad "ep 2 x pp 2 on sim differs"
out="$("${mpi[@]}" -np 4 "$ferry" train "${common[@]}" "${m4[@]}" --ep 2 --pp 2 --device cuda 2>&1)"
[ $? -ne 0 ] && grep -q -- "--ep 2 with --pp 2 on --device cuda: expert parallelism within pipeline stages runs on --device cpu and sim" <<<"$out" \
  && ok "ep 2 x pp 2 on cuda refused" || { bad "ep 2 x pp 2 on cuda"; echo "$out" | tail -3; }

# Layouts that do not fit, refused before anything is allocated.
out="$("${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --ep 4 2>&1)"
[ $? -ne 0 ] && grep -q -- "--ep 4 does not divide the 2 data-parallel ranks" <<<"$out" && ok "ep 4 on 2 ranks refused" \
  || { bad "ep 4 on 2 ranks"; echo "$out" | tail -3; }
out="$("${mpi[@]}" -np 3 "$ferry" train "${common[@]}" --ep 3 2>&1)"
[ $? -ne 0 ] && grep -q -- "--ep 3 does not divide the 4 experts" <<<"$out" && ok "ep 3 of 4 experts refused" \
  || { bad "ep 3 of 4 experts"; echo "$out" | tail -3; }

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
