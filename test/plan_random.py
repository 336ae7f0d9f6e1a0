#!/usr/bin/env python3
"""Every plan ferry plan writes runs, in the memory it says: random machines (the probe's rates
scaled at random, sometimes a disk tier), models, batches, device memory, precisions and numbers of
ranks; for each, `ferry plan --out FILE` (or its refusal: too little memory, no grid for the ranks),
then `ferry train --plan FILE` on those ranks with that device memory and the host memory the plan
says, which must train, with the device peak the plan predicted (to the log's 100 bytes); on the
sim device, half the time, `ferry train --plan auto` too, which must run the same plan. test.sh
runs it on the sim device, and with --gpu on the CUDA emulator (up to FY_EMU_GPUS GPUs; resident
and offloaded plans).

usage: test/plan_random.py path/to/ferry [N] [SEED] [--gpu]     (default 20 cases, seed 1)
Prints one line per case and a summary; exit status 1 when any case broke a rule."""

import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile

RATES = ["device_gflops", "host_gflops", "h2d_gbps", "d2h_gbps", "host_adamw_gbps", "host_mem_gbps",
         "copy_latency_us", "host_copy_gbps", "kernel_overhead_us", "device_mem_gbps"]


def fmt_bytes(b):  # as ferry prints sizes (core/parse.c, fy_format_bytes)
    for unit, scale, digits in (("TiB", 2 ** 40, 2), ("GiB", 2 ** 30, 2), ("MiB", 2 ** 20, 1), ("KiB", 2 ** 10, 1)):
        if b >= scale:
            return "%.*f %s" % (digits, b / scale, unit)
    return "%.0f B" % b


def random_model(rng, path):
    """A random OPT configuration (heads, widths, depth, pre- or post-norm, a projected embedding,
    biases, affine norms, tied or not, activation, dropout) written as path/config.json."""
    heads, head_size = rng.choice([1, 2, 3, 4]), rng.choice([4, 6, 8, 16])
    hidden = heads * head_size
    cfg = dict(model_type="opt", architectures=["OPTForCausalLM"], vocab_size=rng.randint(97, 300),
               hidden_size=hidden, num_attention_heads=heads, ffn_dim=rng.choice([hidden, 2 * hidden, 4 * hidden, 36]),
               num_hidden_layers=rng.randint(1, 3), max_position_embeddings=rng.choice([64, 100]),
               word_embed_proj_dim=hidden if rng.random() < 0.7 else rng.choice([8, 12, 24]),
               do_layer_norm_before=rng.random() < 0.7, enable_bias=rng.random() < 0.8,
               layer_norm_elementwise_affine=rng.random() < 0.8, tie_word_embeddings=rng.random() < 0.7,
               activation_function=rng.choice(["relu", "gelu"]), dropout=rng.choice([0.0, 0.0, 0.1]),
               attention_dropout=0.0, layerdrop=0.0, init_std=0.02, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    os.makedirs(path, exist_ok=True)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    return path


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    gpu = "--gpu" in sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    ferry = os.path.abspath(args[0])
    n = int(args[1]) if len(args) > 1 else 20
    seed = int(args[2]) if len(args) > 2 else 1
    rng = random.Random(seed)
    max_ranks = int(os.environ.get("FY_EMU_GPUS", "4")) if gpu else 4
    mpirun = shutil.which("mpirun")
    tmp = tempfile.mkdtemp(prefix="ferry_plan_random_")
    data = os.path.join(tmp, "data.bin")
    toks = [rng.randrange(97) for _ in range(20000)]  # (every preset's vocabulary holds 97 tokens)
    with open(data, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)))
        f.write(struct.pack("<%dH" % len(toks), *toks))
    device = "cuda" if gpu else "sim"
    base = os.path.join(tmp, "base.json")
    r = subprocess.run([ferry, "probe", "--device", device, "--probe-file", base], capture_output=True, text=True)
    if r.returncode != 0:
        print("ferry probe failed:", r.stderr.strip()[-400:])
        return 1
    probe = json.load(open(base))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    bad = ran = refused = 0
    for case in range(n):
        p = dict(probe)
        for k in RATES:
            if p.get(k, 0) > 0:
                p[k] = p[k] * 10 ** rng.uniform(-1.5, 1.5)
        if p.get("bf16_speedup", 0) > 0:
            p["bf16_speedup"] = max(1.0, p["bf16_speedup"] * 10 ** rng.uniform(-0.3, 0.3))
        disk = rng.random() < 0.25  # a disk tier, and sometimes a host too small for all the state
        if disk:
            p.update(disk_dir=tmp, disk_read_gbps=rng.uniform(0.5, 5), disk_write_gbps=rng.uniform(0.5, 5))
        ppath = os.path.join(tmp, "probe%d.json" % case)
        json.dump(p, open(ppath, "w"))
        model = rng.choice(["opt-tiny", "opt-tiny", "opt-demo", "random"])
        if model == "random":  # an OPT configuration of odd sizes and flags, as a config directory
            model = random_model(rng, os.path.join(tmp, "model%d" % case))
        ranks = rng.choice([r for r in (1, 1, 2, 3, 4) if r <= max_ranks and (r == 1 or mpirun)])
        batch = rng.choice([1, 2, 3, 4, 6, 8])
        seq = rng.choice([16, 32, 48, 64])
        if gpu:  # (a GPU's kernels keep scratch of their own: cuBLASLt's workspace, 32 MiB)
            mem = rng.choice(["33MiB", "34MiB", "36MiB", "40MiB", "48MiB", "256MiB"])
        elif model != "opt-demo":
            mem = rng.choice(["200KiB", "320KiB", "512KiB", "1MiB", "4MiB", "64MiB"])
        else:
            mem = rng.choice(["2MiB", "3MiB", "4MiB", "8MiB", "16MiB", "256MiB"])
        prec = rng.choice(["bf16", "fp32"] if gpu else ["fp32", "bf16", "fp16", ""])
        extra = []
        if gpu and rng.random() < 0.5:
            extra.append("--offload")
        if disk and rng.random() < 0.5:
            extra += ["--host-mem", rng.choice(["256KiB", "512KiB", "2MiB"])]
        common = ["--model", model, "--device", device, "--device-mem", mem] + extra
        if prec:
            common += ["--precision", prec]
        plan = os.path.join(tmp, "plan%d.json" % case)
        log = os.path.join(tmp, "log%d.json" % case)
        what = "%s batch %d x %d, %d rank%s, %s, %s%s%s" % (os.path.basename(model), batch, seq, ranks, "s" * (ranks > 1), mem,
                                                          prec or "default precision", "".join(" " + e for e in extra),
                                                          ", disk tier" if disk else "")
        cmd = [ferry, "plan", "--batch", str(batch), "--seq", str(seq), "--gpus", str(ranks), "--probe-file", ppath,
               "--no-write", "--out", plan] + common
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if r.returncode == 1 and re.search(r"smallest device memory|no way to lay|host memory|cannot hold", r.stderr):
            refused += 1
            print("ok    %s: refused (%s)" % (what, r.stderr.strip().splitlines()[-1][:100]))
            continue
        if r.returncode != 0:
            bad += 1
            print("FAIL  %s: ferry plan exit %d\n  %s\n  %s" % (what, r.returncode, " ".join(cmd), r.stderr.strip()[-500:]))
            continue
        plan_out = r.stdout
        knobs = json.load(open(plan))
        lay = "dp %d x pp %d x tp %d, chunk %d, %s" % (knobs["dp"], knobs.get("pp", 1), knobs["tp"], knobs["chunk_elems"],
                                              "resident" if knobs.get("resident") else "%d blocks" % knobs["blocks"])
        for key, name in (("spec_chunks", "speculated"), ("device_updates", "device updates")):
            if knobs.get(key, 0) > 0:
                lay += ", %d %s" % (knobs[key], name)
        train = ([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks)] if ranks > 1 else []) + [
            ferry, "train", "--data", data, "--plan", plan, "--log", log, "--steps", "2", "--threads", "1", "--seq", str(seq)] + common
        if disk:
            train += ["--disk-dir", tmp]
        if "--host-mem" not in extra and not knobs.get("resident"):  # (and in the host memory it says)
            train += ["--host-mem", str(int(knobs["predicted"]["host_bytes"]) + 1)]
        r = subprocess.run(train, capture_output=True, text=True, env=dict(env, FERRY_PROBE=ppath), timeout=600)
        out = r.stdout + r.stderr
        if r.returncode != 0:
            bad += 1
            errs = [l for l in out.splitlines() if re.search("error|ASSERT|usage|Sanitizer", l)][:3]
            print("FAIL  %s (%s): ferry train exit %d\n  %s\n  %s" % (what, lay, r.returncode, " ".join(train),
                                                                     "\n  ".join(errs) or out[-500:]))
            continue
        ran += 1
        said = knobs["predicted"]["device_peak_bytes"]
        if knobs.get("pp", 1) > 1:  # (a pipeline's log is rank 0's: the first stage's own peak)
            said = knobs["predicted"]["stage_peak_bytes"][0]
        logged = [json.loads(l) for l in open(log)]
        got = max(r["device_peak_mib"] for r in logged) * 2 ** 20
        if abs(got - said) > 128:  # (the log's MiB have 4 decimals)
            bad += 1
            print("FAIL  %s (%s): the plan said a device peak of %.0f bytes, the run's was %.0f (%+.0f)\n  %s" % (
                what, lay, said, got, got - said, " ".join(train)))
            continue
        print("ok    %s (%s): trained, device peak %s as planned" % (what, lay, fmt_bytes(said)))
        # On the sim device, ferry train --plan auto over the same global batch (each rank's share
        # given) runs the plan ferry plan chose: the same plan printed, the same losses.
        if gpu or batch % ranks or rng.random() < 0.5:
            continue
        auto = train[:train.index("--plan")] + ["--plan", "auto", "--batch", str(batch // ranks), "--log", log + ".auto",
                                                "--steps", "2", "--threads", "1", "--seq", str(seq)] + common
        if disk:
            auto += ["--disk-dir", tmp]
        r = subprocess.run(auto, capture_output=True, text=True, env=dict(env, FERRY_PROBE=ppath), timeout=600)
        def plan_lines(out):  # (not ferry plan's parenthesised notes, nor how to run it: its count of plans, its hints)
            return [l for l in out.splitlines() if l.startswith("  ") and not l.startswith(
                ("  (", "  run it:", "     or:", "  a bigger global batch", "  while the norm clips"))]
        said_plan, auto_plan = plan_lines(plan_out), plan_lines(r.stdout)
        losses = [(x["step"], x["loss"]) for x in logged]
        if r.returncode != 0 or auto_plan != said_plan or losses != [
                (x["step"], x["loss"]) for x in map(json.loads, open(log + ".auto"))]:
            bad += 1
            print("FAIL  %s: --plan auto ran another plan (exit %d)\n  %s\n  ferry plan: %s\n  --plan auto: %s" % (
                what, r.returncode, " ".join(auto), said_plan, auto_plan or (r.stdout + r.stderr)[-400:]))
            continue
        print("ok    %s: --plan auto ran the same plan" % what)
    if bad:
        print("(the cases' probes and plans are kept in %s)" % tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print("plan_random (seed %d): %d plans trained, %d refused, %d broke a rule" % (seed, ran, refused, bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
