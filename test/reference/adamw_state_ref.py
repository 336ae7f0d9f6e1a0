#!/usr/bin/env python3
"""ferry's AdamW with 8-bit and bf16 state against this file's own implementation (plain Python).

    adamw_state_ref.py TEST_ADAMW_STATE_EXE

Runs `TEST_ADAMW_STATE_EXE --dump DIR` (test/test_adamw_state.c), which writes the inputs (weights,
m, v, several steps of gradients, the ranges and hyper-parameters) and ferry's state and weights
after every step, then replays the same steps here from the definitions in ops/ops.h, written
again without ferry's code: the 8-bit codes (small floats relative to the block's absmax), the
block's absmax, the ratio through the rounded reciprocal, the nearest code with ties to the even
magnitude, torch.optim.AdamW's formula in float32 (each numpy operation on
operation rounded to float32 as the C rounds it with -ffp-contract=off). Plain Python, no numpy
(not installed by tools/bootstrap.sh), so it runs on every machine that builds ferry. It never
takes ferry's state as its own: the 8-bit and bf16 runs must match to the last code and bit at
every step; fp32 state (fy_adamw_update) within float rounding.
"""
import bisect
import math
import os
import struct
import subprocess
import sys
import tempfile
from array import array

BLOCK = 256
S_M, S_V = 17, 33  # the codes' subnormal steps 2^-S


def f32(xs):
    """Each double rounded to the nearest float32 (C's cast, to nearest even). For operands that
    are float32 values, one +, -, *, / or sqrt in double and then this rounding give exactly the
    float32 operation's result (double has more than 2 * 24 + 2 bits, so rounding twice is
    harmless)."""
    return array("f", xs).tolist()


def f1(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def round24(x):
    """x rounded to 24 significant bits, to nearest even, with no bounds on the exponent (the
    8-bit codes' ratio is defined so)."""
    if x == 0:
        return 0.0
    m, e = math.frexp(x)
    return math.ldexp(f1(m), e)


def magnitudes(S):
    """Magnitude k = 8 e + f (3 mantissa bits f): f 2^-S for e = 0, (8 + f) 2^(e-1-S) for
    e >= 1, up to k = 8 (S - 2), which is 1."""
    out = []
    for k in range(8 * (S - 2) + 1):
        e, f = k >> 3, k & 7
        out.append(math.ldexp(f, -S) if e == 0 else math.ldexp(8 + f, e - 1 - S))
    return out


MAG_M, MAG_V = magnitudes(S_M), magnitudes(S_V)
assert len(MAG_M) == 121 and len(MAG_V) == 249 and MAG_M[-1] == 1 and MAG_V[-1] == 1


def nearest(mag, a):
    """Index of the magnitude nearest to a (in [0, 1 + 2^-23]), a tie to the even index: the
    two neighbours of a by bisection, their distances in double (exact where they tie)."""
    i = bisect.bisect_right(mag, a) - 1
    if i + 1 < len(mag):
        up, down = mag[i + 1] - a, a - mag[i]
        if up < down or (up == down and i % 2 == 1):
            i += 1
    return i


def code_value(c, signed):
    """A code's value; m's -128, never written, as the formula goes on (-2)."""
    k = abs(c)
    e, f = k >> 3, k & 7
    S = S_M if signed else S_V
    v = math.ldexp(f, -S) if e == 0 else math.ldexp(8 + f, e - 1 - S)
    return -v if c < 0 else v


def quantise(x, signed):
    """x (n float32 values) -> codes (n ints, signed for m), scales (blocks)."""
    n = len(x)
    codes, scales = [0] * n, []
    for b0 in range(0, n, BLOCK):
        blk = x[b0:b0 + BLOCK]
        if not all(math.isfinite(e) for e in blk):
            scales.append(float("nan"))
            continue
        amax = max(abs(e) for e in blk)
        scales.append(amax)
        if amax == 0:
            continue
        inv = round24(1.0 / amax)
        for j, e in enumerate(blk):
            r = round24(abs(e) * inv)  # the product of two 24-bit values is exact in double
            if signed:
                k = nearest(MAG_M, r)
                codes[b0 + j] = -k if e < 0 else k
            elif e > 0:
                codes[b0 + j] = max(1, nearest(MAG_V, r))
    return codes, scales


def dequantise(codes, scales, signed):
    out = []
    for i, c in enumerate(codes):
        out.append(code_value(c, signed) * scales[i // BLOCK])
    return f32(out)


def to_bf16(xs):
    """float32 values -> bf16 bits, round to nearest even (finite values)."""
    out = []
    for u in struct.unpack("%dI" % len(xs), struct.pack("%df" % len(xs), *xs)):
        out.append((u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return out


def from_bf16(hs):
    return list(struct.unpack("%df" % len(hs), struct.pack("%dI" % len(hs), *[h << 16 for h in hs])))


def q8_layout(n):
    off = (n + 63) // 64 * 64
    return off, off + 4 * ((n + BLOCK - 1) // BLOCK)


def q8_pack(codes, scales, n):
    off, size = q8_layout(n)
    buf = bytearray(size)
    buf[:n] = bytes(c & 0xFF for c in codes)
    buf[off:] = struct.pack("%df" % len(scales), *scales)
    return bytes(buf)


def adamw(p, mo, vo, g, decay, step, bc2_sqrt, b1, b2, eps, gs):
    """torch.optim.AdamW's element update in float32, in ferry's order (ops/cpu/adamw.c); every
    operation rounded to float32."""
    ob1, ob2 = f1(1.0 - b1), f1(1.0 - b2)
    g = f1(g * gs)
    mi = f1(f1(b1 * mo) + f1(ob1 * g))
    vi = f1(f1(b2 * vo) + f1(f1(ob2 * g) * g))
    p = f1(p * decay)
    den = f1(f1(f1(math.sqrt(vi)) / bc2_sqrt) + eps)
    p = f1(p - f1(step * f1(mi / den)))
    return p, mi, vi


def read_f32(path):
    a = array("f")
    with open(path, "rb") as f:
        a.frombytes(f.read())
    return a.tolist()


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def main():
    exe = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([exe, "--dump", d], check=True)
        meta, ranges = {}, []
        for line in open(os.path.join(d, "meta.txt")):
            k, *v = line.split()
            if k == "range":
                ranges.append((int(v[0]), int(v[1]), float.fromhex(v[2])))
            else:
                meta[k] = v[0]
        n, steps = int(meta["n"]), int(meta["steps"])
        lr, b1, b2, eps = (float.fromhex(meta[k]) for k in ("lr", "beta1", "beta2", "eps"))
        assert int(meta["block"]) == BLOCK
        path = lambda name: os.path.join(d, name)
        p0, m0, v0 = read_f32(path("param.bin")), read_f32(path("m.bin")), read_f32(path("v.bin"))
        allg = read_f32(path("grads.bin"))
        grads = [allg[t * n:(t + 1) * n] for t in range(steps)]
        covered = [False] * n
        for off, cnt, _ in ranges:
            covered[off:off + cnt] = [True] * cnt
        failures = 0
        for w, signed in (("m", True), ("v", False)):  # the nearest-code rule's hard cases
            x = read_f32(path("nearest_%s_in.bin" % w))
            codes, scales = quantise(x, signed)
            mag = MAG_M if signed else MAG_V
            ties = sum(1 for e in x if 0 < abs(e) < 1 and
                       (lambda a, i: i + 1 < len(mag) and a - mag[i] == mag[i + 1] - a)(abs(e), bisect.bisect_right(mag, abs(e)) - 1))
            assert ties > 100, "the hard cases hold too few ties"
            if read_bytes(path("nearest_%s.bin" % w)) != q8_pack(codes, scales, len(x)):
                print("%s: codes of the magnitudes and midpoints differ" % w)
                failures += 1
            else:
                print("%s: %d magnitudes and midpoints (%d exact ties) coded alike" % (w, len(x), ties))
        for run in ("q8", "q8bf", "bf16", "f32"):
            p = list(p0)
            if run.startswith("q8"):
                state = [*quantise(m0, True), *quantise(v0, False)]
                want = [q8_pack(state[0], state[1], n), q8_pack(state[2], state[3], n)]
            elif run == "bf16":
                state = [to_bf16(m0), to_bf16(v0)]
                want = [struct.pack("%dH" % n, *h) for h in state]
            else:
                state = [list(m0), list(v0)]
                want = None
            if want is not None and [read_bytes(path(run + "_m0.bin")), read_bytes(path(run + "_v0.bin"))] != want:
                print("%s: the encoded initial state differs" % run)
                failures += 1
            worst = 0.0
            for t in range(1, steps + 1):
                gs = 1.0 if t % 2 else 0.5
                g = grads[t - 1]
                if run == "q8bf":
                    g = from_bf16(to_bf16(g))
                step = f1(lr / (1.0 - b1 ** t))
                bc2_sqrt = f1(math.sqrt(1.0 - b2 ** t))
                if run.startswith("q8"):
                    mo, vo = dequantise(state[0], state[1], True), dequantise(state[2], state[3], False)
                elif run == "bf16":
                    mo, vo = from_bf16(state[0]), from_bf16(state[1])
                else:
                    mo, vo = state
                mn, vn = list(mo), list(vo)
                for off, cnt, wd in ranges:
                    decay = f1(1.0 - lr * wd)
                    for i in range(off, off + cnt):
                        p[i], mn[i], vn[i] = adamw(p[i], mo[i], vo[i], g[i], decay, step, bc2_sqrt, b1, b2, eps, gs)
                got_p = read_f32(path("%s_param%d.bin" % (run, t)))
                got_m, got_v = read_bytes(path("%s_m%d.bin" % (run, t))), read_bytes(path("%s_v%d.bin" % (run, t)))
                if run == "f32":  # within float rounding: relative to each value
                    state = [mn, vn]
                    for name, a, b in (("param", got_p, p), ("m", array("f", got_m).tolist(), mn),
                                       ("v", array("f", got_v).tolist(), vn)):
                        err = max(abs(x - y) / (abs(y) + 1e-30) for x, y in zip(a, b))
                        worst = max(worst, err)
                        if err > 1e-6:
                            print("f32 step %d %s: relative error %.3g" % (t, name, err))
                            failures += 1
                    continue
                if run.startswith("q8"):
                    state = [*quantise(mn, True), *quantise(vn, False)]
                    want_m, want_v = q8_pack(state[0], state[1], n), q8_pack(state[2], state[3], n)
                else:
                    state = [to_bf16(mn), to_bf16(vn)]
                    want_m, want_v = struct.pack("%dH" % n, *state[0]), struct.pack("%dH" % n, *state[1])
                bad = []
                if struct.pack("%df" % n, *got_p) != struct.pack("%df" % n, *p):
                    bad.append("param (%d elements)" % sum(x != y for x, y in zip(got_p, p)))
                if got_m != want_m:
                    bad.append("m")
                if got_v != want_v:
                    bad.append("v")
                if run == "q8bf":
                    got_gw = list(struct.unpack("%dH" % n, read_bytes(path("%s_gw%d.bin" % (run, t)))))
                    new_w, g_in = to_bf16(p), to_bf16(grads[t - 1])
                    if got_gw != [w if c else h for w, h, c in zip(new_w, g_in, covered)]:
                        bad.append("bf16 weights in the gradients' copy")
                if bad:
                    print("%s step %d: %s differ" % (run, t, ", ".join(bad)))
                    failures += 1
            if run == "f32":
                print("f32: the largest relative difference over %d steps: %.3g" % (steps, worst))
            elif run.startswith("q8"):
                nz = sum(c != 0 for c in state[0]) + sum(c != 0 for c in state[2])
                print("%s: %d steps equal to the last code and bit (%d of %d codes nonzero)" % (run, steps, nz, 2 * n))
            else:
                print("%s: %d steps equal to the last bit" % (run, steps))
        print("adamw_state_ref: %s" % ("FAILED" if failures else "ok"))
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
