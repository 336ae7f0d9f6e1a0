#!/usr/bin/env python3
"""ferry train (and, one run in four, ferry eval) with random sets of options, valid and not: every
run must end by itself, with exit status 0 (trained, evaluated), 1 (refused or failed, with a
message) or 2 (bad usage, with a message), and without a sanitizer report. test.sh runs it on the
AddressSanitizer build.

usage: test/cli_random.py path/to/ferry [N] [SEED]       (default 60 runs, seed 1)
Prints one line per run that breaks a rule and a summary; exit status 1 when any did."""

import os
import random
import struct
import subprocess
import sys
import tempfile

# Each option with values inside and outside what it takes (sizes, probabilities, paths, names).
def option_values(tmp, data):
    return {
        "--batch": ["0", "1", "2", "-1", "x", "100000"], "--seq": ["0", "1", "12", "33", "999999"],
        "--steps": ["0", "1", "2", "-3"], "--grad-accum": ["0", "1", "2", "3"],
        "--lr": ["0", "-1", "nan", "1e-3", "inf"], "--warmup": ["0", "5", "-1"], "--min-lr": ["0", "-1", "1e-4"],
        "--schedule": ["cosine", "linear", "constant", "bogus"], "--clip": ["0", "-1", "1"],
        "--device": ["cpu", "sim", "cuda", "tpu"], "--device-mem": ["1", "1KiB", "1MiB", "64MiB", "0", "-5", "12XB"],
        "--blocks": ["0", "1", "3", "-1"], "--prefetch": ["0", "1", "9", "-1"], "--device-chunks": ["0", "1", "1000", "-1"],
        "--disk-chunks": ["0", "1", "5", "-2"], "--disk-dir": [tmp, "/nonexistent"], "--host-mem": ["1KiB", "64MiB", "0"],
        "--precision": ["fp32", "bf16", "fp16", "int8"], "--dropout": ["0", "0.5", "1", "-0.1", "config", "x"],
        "--loss-scale": ["0", "1", "3", "65536", "dynamic"], "--save-every": ["0", "1", "-1"], "--keep": ["0", "1", "3"],
        "--stop-after": ["0", "1", "-1"], "--val-every": ["0", "1", "-1"], "--val-batches": ["0", "1", "-1"],
        "--val-data": [data, "/nonexistent"], "--threads": ["0", "1", "2", "-1"], "--tp": ["1", "2", "0"],
        "--chunk-mib": ["0", "0.001", "1", "-1"], "--plan": ["auto", "/nonexistent"], "--seed": ["0", "1", "-1"],
        "--eps": ["0", "-1", "1e-8"], "--beta1": ["0", "1", "1.5"], "--beta2": ["0", "0.999", "2"],
        "--weight-decay": ["0", "-1"], "--sim-link-gbps": ["0", "1", "-1"],
        "--resume": [os.path.join(tmp, "ck"), "/nonexistent"], "--save": [os.path.join(tmp, "ck"), os.path.join(tmp, "out")],
        "--model": ["opt-tiny", "opt-demo", "opt-bogus"],
    }


FLAGS = ["--recompute", "--no-shuffle", "--offload", "--profile"]


# ferry eval's options (and a training one it does not take: bad usage), the model saved by a
# short run among the --init values.
def eval_values(values, tmp, saved):
    keep = ["--batch", "--seq", "--device", "--device-mem", "--precision", "--host-mem", "--tp", "--threads", "--seed",
            "--model"]
    ev = {k: values[k] for k in keep}
    ev.update({"--batches": ["0", "1", "3", "-1", "x"], "--init": ["random", saved, "/nonexistent"],
               "--dump": [os.path.join(tmp, "dump.safetensors"), "/nonexistent/dump.safetensors"],
               "--lr": ["1e-3"]})
    return ev


EVAL_FLAGS = ["--recompute", "--offload"]


def main():
    ferry = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    rnd = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "tokens.bin")
        toks = [rnd.randrange(97) for _ in range(3000)]
        with open(data, "wb") as f:
            f.write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)))
            f.write(struct.pack("<%dH" % len(toks), *toks))
        values = option_values(tmp, data)
        saved = os.path.join(tmp, "saved")
        subprocess.run([ferry, "train", "--model", "opt-tiny", "--data", data, "--quiet", "--steps", "1", "--seq", "12",
                        "--batch", "2", "--save", saved], check=True, capture_output=True, timeout=120)
        evals = eval_values(values, tmp, saved)
        for i in range(n):
            if rnd.random() < 0.25:
                cmd = [ferry, "eval", "--model", "opt-tiny", "--data", data]
                for k in rnd.sample(sorted(evals), rnd.randint(1, 5)):
                    cmd += [k, rnd.choice(evals[k])]
                cmd += [f for f in EVAL_FLAGS if rnd.random() < 0.15]
                defaults = (("--batches", "2"), ("--seq", "12"), ("--batch", "2"))
            else:
                cmd = [ferry, "train", "--model", "opt-tiny", "--data", data, "--quiet"]
                for k in rnd.sample(sorted(values), rnd.randint(1, 6)):
                    cmd += [k, rnd.choice(values[k])]
                cmd += [f for f in FLAGS if rnd.random() < 0.15]
                defaults = (("--steps", "2"), ("--seq", "12"), ("--batch", "2"))
            for k, v in defaults:
                if k not in cmd:
                    cmd += [k, v]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                code, err = r.returncode, r.stderr
            except subprocess.TimeoutExpired:
                code, err = "a timeout (120 s)", ""
            why = None
            if code not in (0, 1, 2):
                why = f"ended with {code}"
            elif "Sanitizer" in err or "runtime error:" in err:
                why = "a sanitizer report"
            elif code != 0 and not err.strip():
                why = f"exit {code} without a message"
            if why:
                bad += 1
                print(f"run {i}: {why}: {' '.join(cmd[1:])}\n  {err.strip()[-400:]}")
    print(f"cli_random: {n - bad} of {n} runs ended as they should")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
