#!/usr/bin/env python3
"""OPT configurations the committed fixtures do not cover, trained by ferry and by transformers.

The fixtures (make_reference.py) pin two shapes with biases, affine layer norms and a tied
lm_head. Checkpoints in the wild also come without biases (enable_bias false), without layer-norm
weights (layer_norm_elementwise_affine false), with an untied lm_head, with no final layer norm
(_remove_final_layer_norm), with project_in/out in a pre-LN model, with gelu for relu (Galactica,
an OPT model), stored in bf16 or f16, or split into several safetensors files. For each such variant this builds a small random model with
transformers, saves it, and then:

  1. ferry trains it 5 steps (constant learning rate, clipping, weight decay, batches in order)
     and transformers trains it on the same sequences with torch.optim.AdamW: every step's loss
     within 1e-5 relative;
  2. the weights ferry saves equal transformers' after the same steps (normalised error of each
     tensor within 1e-4), and the saved checkpoint has transformers' tensor names, no more, no less;
  3. an activation that ferry does not implement (silu) is refused with a message, not trained wrongly.

The "dropout" variant trains with the config's dropout (0.1, ferry train --dropout config) and
transformers in train mode, its dropout handed ferry's masks (ops/dropout.h, repeated here in
numpy): the same checks then hold, which pins where ferry drops (the residual branches after
out_proj and fc2), how it scales (1 / (1 - p)) and that backward uses the forward's masks.

usage: test/reference/check_variants.py path/to/ferry [--keep DIR]
Exit status 0 when every variant passes, 1 otherwise. Needs torch, transformers, safetensors.
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

B, T, STEPS = 2, 12, 5
LR, BETA1, BETA2, EPS, WEIGHT_DECAY, CLIP = 1e-2, 0.9, 0.95, 1e-8, 0.1, 1.0
VOCAB = 67

BASE = dict(vocab_size=VOCAB, hidden_size=24, num_attention_heads=3, ffn_dim=40, num_hidden_layers=2,
            max_position_embeddings=32, word_embed_proj_dim=24, do_layer_norm_before=True,
            dropout=0.0, attention_dropout=0.0, layerdrop=0.0, activation_function="relu")

# name: (config changes, weights dtype, max shard size)
VARIANTS = {
    "no_bias": (dict(enable_bias=False), "float32", None),
    "no_affine": (dict(layer_norm_elementwise_affine=False), "float32", None),
    "untied": (dict(tie_word_embeddings=False), "float32", None),
    "no_final_ln": (dict(_remove_final_layer_norm=True), "float32", None),
    "pre_ln_proj": (dict(word_embed_proj_dim=16), "float32", None),
    "post_ln_untied_no_bias": (dict(do_layer_norm_before=False, tie_word_embeddings=False, enable_bias=False),
                               "float32", None),
    "one_head": (dict(num_attention_heads=1), "float32", None),
    "gelu": (dict(activation_function="gelu"), "float32", None),
    "post_ln_gelu_untied": (dict(activation_function="gelu", do_layer_norm_before=False, tie_word_embeddings=False),
                            "float32", None),
    "bf16_weights": (dict(), "bfloat16", None),
    "f16_sharded": (dict(), "float16", "20KB"),
    "dropout": (dict(dropout=0.1), "float32", None),
    "post_ln_dropout": (dict(dropout=0.2, do_layer_norm_before=False, word_embed_proj_dim=16), "float32", None),
    "loss_mask": (dict(), "float32", None),
}
# The loss_mask variant trains on the shard with a loss mask beside it (runtime/data.h; as
# tools/tokenize.py --prompt writes): transformers gets labels -100 where the mask is 0.
DROPOUT_SEED = 4321

# ---- ferry's dropout masks (ops/dropout.h), for transformers ----

M64 = (1 << 64) - 1


def _mix64(x):  # x: a uint64 numpy array, or a Python int (kept to 64 bits)
    import numpy as np
    if isinstance(x, int):
        x ^= x >> 30; x = (x * 0xbf58476d1ce4e5b9) & M64
        x ^= x >> 27; x = (x * 0x94d049bb133111eb) & M64
        return x ^ (x >> 31)
    x = x ^ (x >> np.uint64(30)); x = x * np.uint64(0xbf58476d1ce4e5b9)
    x = x ^ (x >> np.uint64(27)); x = x * np.uint64(0x94d049bb133111eb)
    return x ^ (x >> np.uint64(31))


def _mix32(x):  # a uint32 numpy array
    import numpy as np
    x = x ^ (x >> np.uint32(16)); x = x * np.uint32(0x85ebca6b)
    x = x ^ (x >> np.uint32(13)); x = x * np.uint32(0xc2b2ae35)
    return x ^ (x >> np.uint32(16))


def ferry_keep(seed, site, u0, rows, C, p):
    """Which elements ferry keeps: a (rows, C) boolean array for tokens u0 .. u0 + rows - 1."""
    import numpy as np
    with np.errstate(over="ignore"):
        key = _mix64((_mix64(seed) + (site + 1) * 0x9e3779b97f4a7c15) & M64)
        u = np.arange(u0, u0 + rows, dtype=np.uint64)
        tok = _mix64(np.uint64(key) ^ (u * np.uint64(0xd1b54a32d192ed03)))
        lo, hi = (tok & np.uint64(0xffffffff)).astype(np.uint32), (tok >> np.uint64(32)).astype(np.uint32)
        j = np.arange(C, dtype=np.uint32) * np.uint32(0x9e3779b9)
        draw = _mix32((lo[:, None] + j[None, :]) ^ hi[:, None])
    thr = 0 if p <= 0 else min(int(float(np.float32(p)) * 4294967296.0), 0xffffffff)
    return draw >= np.uint32(thr)


class FerryDropout:
    """Stands in for torch.nn.functional.dropout while transformers trains: the k-th dropping call
    of a forward is ferry's site k (layer k // 2, attention then feed-forward). transformers runs
    the T + 1 tokens of each window (its labels shift inside the model): position t < T of
    sequence j is ferry's token u0 + jT + t; the last position, whose prediction no loss reads,
    keeps everything."""

    def __init__(self, torch, seed):
        self.torch, self.seed, self.orig = torch, seed, torch.nn.functional.dropout
        self.site, self.u0 = 0, 0

    def start(self, u0):
        self.site, self.u0 = 0, u0

    def __call__(self, x, p=0.5, training=True, inplace=False):
        import numpy as np
        if not training or p == 0:
            return self.orig(x, p, training, inplace)
        C = x.shape[-1]
        n_seq = x.numel() // C // (T + 1)
        keep = np.concatenate([np.concatenate([ferry_keep(self.seed, self.site, self.u0 + j * T, T, C, p),
                                               np.ones((1, C), dtype=bool)]) for j in range(n_seq)])
        self.site += 1
        scale = np.float32(1) / (np.float32(1) - np.float32(p))
        m = self.torch.from_numpy(keep.astype(np.float32) * scale).reshape(x.shape)
        return x * m


def build(torch, name, changes, dtype, shard, outdir):
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(sum(map(ord, name)))
    cfg = OPTConfig(**{**BASE, **changes})
    model = OPTForCausalLM(cfg)
    with torch.no_grad():  # non-trivial values everywhere (zero biases and unit norms hide bugs)
        for n, p in model.named_parameters():
            one = 1.0 if "layer_norm" in n and n.endswith(".weight") else 0.0
            p.copy_(one + 0.1 * torch.randn(p.shape))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(outdir, max_shard_size=shard or "5GB")


def write_shard(path, n=4000):
    import random
    rnd = random.Random(7)
    toks = [rnd.randrange(3, VOCAB) for _ in range(n)]
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)))
        f.write(struct.pack("<%dH" % len(toks), *toks))
    return toks


def write_mask(shard_path, n):
    """A loss mask beside the shard (X.bin -> X.mask): runs of prompt (0) and response (1) tokens."""
    import random
    rnd = random.Random(11)
    mask, learn = [], 0
    while len(mask) < n:
        mask += [learn] * rnd.randrange(1, 9)
        learn ^= 1
    mask = mask[:n]
    with open(shard_path[:-len(".bin")] + ".mask", "wb") as f:
        f.write(struct.pack("<256i", 20241201, 1, n, *([0] * 253)))
        f.write(bytes(mask))
    return mask


def load_initial(torch, path):
    from transformers import OPTForCausalLM
    return OPTForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def hf_train(torch, path, toks, dropout=False, mask=None):
    """Loss of each step and the final weights: ferry's loader takes window i = tokens [iT, iT + T]
    (T + 1 tokens) and row j of batch k is window kB + j; transformers' labels = input_ids shift
    by one inside the model, so the T + 1 tokens of a window give the same T predictions. With
    dropout, transformers drops with ferry's masks (row j of batch k: tokens (kB + j)T ...)."""
    from transformers import OPTForCausalLM
    model = OPTForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.train()
    drop = FerryDropout(torch, DROPOUT_SEED) if dropout else None
    if drop:
        torch.nn.functional.dropout = drop
    named = list(model.named_parameters())
    groups = [dict(params=[p for _, p in named if p.ndim >= 2], weight_decay=WEIGHT_DECAY),
              dict(params=[p for _, p in named if p.ndim < 2], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(BETA1, BETA2), eps=EPS)
    losses = []
    for k in range(STEPS):
        rows = [toks[(k * B + j) * T:(k * B + j) * T + T + 1] for j in range(B)]
        ids = torch.tensor(rows, dtype=torch.long)
        labels = ids.clone()
        if mask is not None:  # label i is the target of position i - 1: stream token (kB + j)T + i
            for j in range(B):
                for i in range(1, T + 1):
                    if not mask[(k * B + j) * T + i]:
                        labels[j, i] = -100
        opt.zero_grad(set_to_none=True)
        if drop:
            drop.start(k * B * T)
        out = model(input_ids=ids, labels=labels, use_cache=False)
        if drop and drop.site != 2 * model.config.num_hidden_layers:
            raise RuntimeError(f"transformers dropped at {drop.site} places, not 2 per layer")
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(out.loss.item())
    if drop:
        torch.nn.functional.dropout = drop.orig
    return losses, model


def ferry_train(ferry, src, data, save, log, extra=()):
    cmd = [ferry, "train", "--init", src, "--data", data, "--batch", str(B), "--seq", str(T), *extra,
           "--steps", str(STEPS), "--lr", repr(LR), "--min-lr", repr(LR), "--warmup", "0",
           "--weight-decay", repr(WEIGHT_DECAY), "--beta1", repr(BETA1), "--beta2", repr(BETA2),
           "--eps", repr(EPS), "--clip", repr(CLIP), "--no-shuffle", "--threads", "2", "--quiet",
           "--log", log, "--save", save]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("ferry train failed: " + (r.stderr or r.stdout).strip())
    return [json.loads(line)["loss"] for line in open(log) if line.strip()]


def check_variant(torch, ferry, tmp, name, spec, toks, data):
    from safetensors.torch import load_file
    changes, dtype, shard = spec
    src, save, log = (os.path.join(tmp, name + s) for s in ("", ".saved", ".log"))
    build(torch, name, changes, dtype, shard, src)
    problems = []
    dropout = changes.get("dropout", 0) > 0
    extra = ("--dropout", "config", "--seed", str(DROPOUT_SEED)) if dropout else ()
    mask = None
    if name == "loss_mask":
        os.makedirs(os.path.join(tmp, "masked"), exist_ok=True)
        data = os.path.join(tmp, "masked", "tokens.bin")
        write_shard(data)
        mask = write_mask(data, len(toks))
    ferry_losses = ferry_train(ferry, src, data, save, log, extra)
    hf_losses, model = hf_train(torch, src, toks, dropout, mask)
    if len(ferry_losses) != STEPS:
        problems.append(f"ferry logged {len(ferry_losses)} steps, not {STEPS}")
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(ferry_losses, hf_losses))
    if loss_err > 1e-5:
        problems.append(f"losses differ by {loss_err:.2e} relative: ferry {ferry_losses}, transformers {hf_losses}")
    saved = {}
    for f in sorted(os.listdir(save)):
        if f.endswith(".safetensors"):
            saved.update(load_file(os.path.join(save, f)))
    want = {n: p.detach() for n, p in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        want.pop("lm_head.weight", None)  # tied: a checkpoint holds only the embedding
    missing, extra = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
    if missing or extra:
        problems.append(f"saved tensor names: missing {missing}, unexpected {extra}")
    w_err = 0.0
    initial = {n: p.detach().float() for n, p in load_initial(torch, src).items()}
    for n in set(want) & set(saved):
        a, b = saved[n].float(), want[n].float()
        if a.shape != b.shape:
            problems.append(f"{n}: saved shape {tuple(a.shape)}, transformers {tuple(b.shape)}")
            continue
        if n.endswith("self_attn.k_proj.bias"):
            # Its analytic gradient is zero (a shift of every key moves no softmax), so Adam moves
            # it by normalised rounding noise, different in every implementation: at most lr a step.
            bound = 1.01 * LR * STEPS
            if ((a - initial[n]).abs().max() > bound) or ((b - initial[n]).abs().max() > bound):
                problems.append(f"{n} moved more than Adam's bound of {bound}")
            continue
        w_err = max(w_err, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    if w_err > 1e-4:
        problems.append(f"weights after {STEPS} steps differ by {w_err:.2e} (normalised)")
    print(json.dumps({"variant": name, "loss_rel_err": float(f"{loss_err:.3g}"),
                      "weights_rel_err": float(f"{w_err:.3g}"), "ok": not problems}))
    for p in problems:
        print(f"  {name}: {p}")
    return not problems


def check_refused(torch, ferry, tmp, data):
    """A configuration ferry does not implement must be refused, naming the setting."""
    src = os.path.join(tmp, "silu")
    build(torch, "silu", dict(activation_function="silu"), "float32", None, src)
    r = subprocess.run([ferry, "train", "--init", src, "--data", data, "--batch", str(B), "--seq", str(T),
                        "--steps", "1", "--quiet"], capture_output=True, text=True)
    ok = r.returncode != 0 and "silu" in r.stderr and "Sanitizer" not in r.stderr
    print(json.dumps({"variant": "silu (refused)", "exit": r.returncode, "ok": ok}))
    if not ok:
        print("  silu: expected a non-zero exit naming the activation; got:", (r.stderr or r.stdout).strip()[:300])
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ferry")
    ap.add_argument("--keep", metavar="DIR", help="build the models in DIR and keep them")
    ap.add_argument("--only", help="one variant")
    args = ap.parse_args()
    # transformers' progress bars and advice would bury the one line a variant prints
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    torch.set_num_threads(2)
    names = [args.only] if args.only else list(VARIANTS)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        os.makedirs(tmp, exist_ok=True)
        data = os.path.join(tmp, "tokens.bin")
        toks = write_shard(data)
        ok = all([check_variant(torch, args.ferry, tmp, n, VARIANTS[n], toks, data) for n in names])
        if not args.only:
            ok = check_refused(torch, args.ferry, tmp, data) and ok
    print("variants:", "all passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
