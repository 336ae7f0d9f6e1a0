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

With --random N, N configurations drawn at random instead (sizes, flags, activation, dropout,
weights' dtype, batch and sequence, loss masks), each trained by ferry along a random path that
must not change the numbers (threads, accumulation, 2 to 4 ranks data- or tensor-parallel, the
sim device with few blocks, prefetch, device and disk chunks, the planner's choice,
recomputation, a resume part-way), on shuffled or wrapping data, with validation while training
on some, and on half ferry eval of the weights it saved. A case whose trajectory parts from transformers' is judged against float64
transformers, and then step by step from ferry's own weights (stepwise).

usage: test/reference/check_variants.py path/to/ferry [--only NAME] [--random N [--seed S] [--case I]] [--keep DIR]
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
DROPOUT_SEED = 4321  # ferry's --seed where it drops or shuffles: its masks and its permutation
# AdamW's eps in the random configurations. Their small batches leave gradient elements near zero,
# whose sign is rounding noise; with eps 1e-8 Adam turns each into a full step of lr, different in
# every implementation. 1e-6 keeps such steps small and leaves every real one as it was.
RANDOM_EPS = 1e-6

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

    def __init__(self, torch, seed, T):
        self.torch, self.seed, self.T, self.orig = torch, seed, T, torch.nn.functional.dropout
        self.site, self.u0 = 0, 0

    def start(self, u0):
        self.site, self.u0 = 0, u0

    def __call__(self, x, p=0.5, training=True, inplace=False):
        import numpy as np
        if not training or p == 0:
            return self.orig(x, p, training, inplace)
        C, T = x.shape[-1], self.T
        n_seq = x.numel() // C // (T + 1)
        keep = np.concatenate([np.concatenate([ferry_keep(self.seed, self.site, self.u0 + j * T, T, C, p),
                                               np.ones((1, C), dtype=bool)]) for j in range(n_seq)])
        self.site += 1
        scale = np.float32(1) / (np.float32(1) - np.float32(p))
        m = self.torch.from_numpy(keep.astype(np.float32) * scale).reshape(x.shape).to(x.dtype)
        return x * m


def build(torch, name, changes, dtype, shard, outdir, seed=None):
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(sum(map(ord, name)) if seed is None else seed)
    cfg = OPTConfig(**{**BASE, **changes})
    model = OPTForCausalLM(cfg)
    with torch.no_grad():  # non-trivial values everywhere (zero biases and unit norms hide bugs)
        for n, p in model.named_parameters():
            one = 1.0 if "layer_norm" in n and n.endswith(".weight") else 0.0
            p.copy_(one + 0.1 * torch.randn(p.shape))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(outdir, max_shard_size=shard or "5GB")


def write_shard(path, n=4000, vocab=VOCAB, low=3, seed=7):
    import random
    rnd = random.Random(seed)
    toks = [rnd.randrange(low, vocab) for _ in range(n)]
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)))
        f.write(struct.pack("<%dH" % len(toks), *toks))
    return toks


def write_mask(shard_path, n, seed=11):
    """A loss mask beside the shard (X.bin -> X.mask): runs of prompt (0) and response (1) tokens."""
    import random
    rnd = random.Random(seed)
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


# ---- ferry's data stream (runtime/data.c), for transformers ----

def _xoshiro256ss(s):
    """One number of xoshiro256** from the state s (a list of 4 uint64, updated)."""
    def rotl(x, k):
        return ((x << k) | (x >> (64 - k))) & M64
    result = (rotl((s[1] * 5) & M64, 7) * 9) & M64
    t = (s[1] << 17) & M64
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t
    s[3] = rotl(s[3], 45)
    return result


def ferry_perm(seed, epoch, n):
    """The order of the n windows in an epoch of a shuffled run: Fisher-Yates, j drawn by rejection
    from xoshiro256** seeded by splitmix64 from seed ^ (epoch * 0xD1B54A32D192ED03)."""
    x = (seed ^ ((epoch * 0xD1B54A32D192ED03) & M64)) & M64
    st = []
    for _ in range(4):
        x = (x + 0x9e3779b97f4a7c15) & M64
        st.append(_mix64(x))
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        limit = M64 - M64 % bound
        while True:
            r = _xoshiro256ss(st)
            if r < limit:
                break
        j = r % bound
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def stream_windows(n_tokens, T, count, shuffle=None):
    """The windows (index w: tokens [wT, wT + T]) of stream elements 0 .. count - 1: in order, or
    shuffled with seed `shuffle`; an epoch visits every window of the data once."""
    nw = (n_tokens - 1) // T
    perms = {}
    out = []
    for el in range(count):
        epoch, w = divmod(el, nw)
        if shuffle is not None:
            if epoch not in perms:
                perms[epoch] = ferry_perm(shuffle, epoch, nw)
            w = perms[epoch][w]
        out.append(w)
    return out


def hf_train(torch, path, toks, B=B, T=T, dropout=False, mask=None, dtype="float32", eps=EPS, shuffle=None):
    """Loss of each step and the final weights: ferry's loader takes window w = tokens [wT, wT + T]
    (T + 1 tokens) and row j of batch k is stream element kB + j: window kB + j in order (the
    data wrapping around), or that element's window in ferry's shuffle with seed `shuffle`.
    transformers' labels = input_ids shift by one inside the model, so the T + 1 tokens of a
    window give the same T predictions. With dropout, transformers drops with ferry's masks,
    which follow the stream (row j of batch k: stream tokens (kB + j)T ...). dtype float64 gives
    the exact numbers that fp32 ferry and fp32 transformers both round."""
    from transformers import OPTForCausalLM
    model = OPTForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="eager")
    model.train()
    drop = FerryDropout(torch, DROPOUT_SEED, T) if dropout else None
    if drop:
        torch.nn.functional.dropout = drop
    named = list(model.named_parameters())
    groups = [dict(params=[p for _, p in named if p.ndim >= 2], weight_decay=WEIGHT_DECAY),
              dict(params=[p for _, p in named if p.ndim < 2], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(BETA1, BETA2), eps=eps)
    losses = []
    windows = stream_windows(len(toks), T, STEPS * B, shuffle)
    for k in range(STEPS):
        batch = step_batch(torch, toks, windows, k, B, T, mask)
        if batch is None:
            losses.append(None)  # ferry updates nothing in a step without a target; nor does this
            continue
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(torch, model, *batch, drop, k * B * T)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    if drop:
        torch.nn.functional.dropout = drop.orig
    return losses, model


def step_batch(torch, toks, windows, k, B, T, mask=None):
    """Step k's input ids and labels ((B, T + 1) each; -100 where the loss mask is 0), or None when
    no target counts."""
    win = [windows[k * B + j] for j in range(B)]
    ids = torch.tensor([toks[w * T:w * T + T + 1] for w in win], dtype=torch.long)
    labels = ids.clone()
    if mask is not None:  # label i is the target of position i - 1: token wT + i
        for j in range(B):
            for i in range(1, T + 1):
                if not mask[win[j] * T + i]:
                    labels[j, i] = -100
    return None if bool((labels[:, 1:] == -100).all()) else (ids, labels)


def lm_loss(torch, model, ids, labels, drop=None, u0=0):
    """The mean next-token cross-entropy over the counted targets, in the model's dtype
    (transformers' own loss rounds the logits to float32 first), dropping with ferry's masks from
    stream token u0 when drop is given."""
    if drop:
        drop.start(u0)
    logits = model(input_ids=ids, use_cache=False).logits
    if drop and drop.site != 2 * model.config.num_hidden_layers:
        raise RuntimeError(f"transformers dropped at {drop.site} places, not 2 per layer")
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)


def ferry_runs(ferry, src, data, save, log, runs, B=B, T=T, eps=EPS, shuffle=None, every=None):
    """ferry trains the model at src STEPS steps, in runs: each but the last stops after
    run["stop_after"] steps with a checkpoint in save, from which the next resumes (each its own
    way: extra, launch). every: a checkpoint after every that many steps, all kept. Returns the
    step losses (None: a step without a target) and the directory of the saved weights."""
    losses = []
    for i, run in enumerate(runs):
        cmd = [*run["launch"], ferry, "train", "--init", src, "--data", data, "--seq", str(T), *run["extra"],
               "--steps", str(STEPS), "--lr", repr(LR), "--min-lr", repr(LR), "--warmup", "0",
               "--weight-decay", repr(WEIGHT_DECAY), "--beta1", repr(BETA1), "--beta2", repr(BETA2),
               "--eps", repr(eps), "--clip", repr(CLIP), "--quiet", "--log", f"{log}.{i}", "--save", save]
        cmd += ["--no-shuffle"] if shuffle is None else ["--seed", str(shuffle)]
        if "--batch" not in run["extra"]:
            cmd += ["--batch", str(B)]
        if "--threads" not in run["extra"]:
            cmd += ["--threads", "2"]
        if len(runs) > 1 or every:
            cmd += ["--save-every", str(every or STEPS), "--keep", str(STEPS + 1)]
        if i > 0:
            cmd += ["--resume", save]
        if "stop_after" in run:
            cmd += ["--stop-after", str(run["stop_after"])]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ferry train failed ({' '.join(cmd)}): " + (r.stderr or r.stdout).strip())
        losses += [json.loads(line)["loss"] for line in open(f"{log}.{i}") if line.strip()]
    weights = save
    if len(runs) > 1 or every:  # a checkpoint root: its latest step
        weights = os.path.join(save, open(os.path.join(save, "latest")).read().strip())
    return losses, weights


def stepwise(torch, ferry, tmp, name, src, data, toks, B, T, dropout, mask, runs, eps, shuffle):
    """ferry's every step against transformers from ferry's own weights, which no divergence of
    two trajectories can upset (a ReLU input or a gradient element near zero at one step can part
    them for good): ferry runs again with a checkpoint after every step; at step k, transformers
    (float64) takes the gradient of step k's batch at the weights ferry had after step k - 1, and
    ferry's own gradient comes from its AdamW state, m_k = beta1 m_(k-1) + (1 - beta1) c g_k (c
    the clipping factor of its logged norm). Returns the problems found (none: every gradient and
    loss agrees)."""
    import shutil
    from safetensors.torch import load_file
    from transformers import OPTForCausalLM
    root, log = os.path.join(tmp, name + ".steps"), os.path.join(tmp, name + ".steps.log")
    shutil.rmtree(root, ignore_errors=True)
    ferry_runs(ferry, src, data, root, log, runs, B, T, eps, shuffle, every=1)
    logged = [json.loads(line) for i in range(len(runs)) for line in open(f"{log}.{i}") if line.strip()]
    windows = stream_windows(len(toks), T, STEPS * B, shuffle)
    drop = FerryDropout(torch, DROPOUT_SEED, T) if dropout else None
    problems, prev, m_prev = [], src, None
    for k in range(STEPS):
        here = os.path.join(root, f"step-{k + 1:08d}")
        m_k = {n[len("exp_avg."):]: v.double() for n, v in load_file(os.path.join(here, "optimizer.safetensors")).items()
               if n.startswith("exp_avg.")}
        batch = step_batch(torch, toks, windows, k, B, T, mask)
        if batch is not None:
            model = OPTForCausalLM.from_pretrained(prev, dtype=torch.float64, attn_implementation="eager")
            model.train()
            # How close to zero the step's ReLU inputs come, relative to their layer's largest
            # (ferry's fp32 may see the other side of zero than float64 where they nearly touch)
            kink = [1.0]
            if model.config.activation_function == "relu":
                def near(mod, inputs, out):
                    a = out.detach().abs()
                    kink[0] = min(kink[0], (a.min() / a.max().clamp_min(1e-300)).item())
                for layer in model.model.decoder.layers:
                    layer.fc1.register_forward_hook(near)
            if drop:
                torch.nn.functional.dropout = drop
            try:
                loss = lm_loss(torch, model, *batch, drop, k * B * T)
            finally:
                if drop:
                    torch.nn.functional.dropout = drop.orig
            loss.backward()
            if abs(logged[k]["loss"] - loss.item()) > 1e-5 * abs(loss.item()) + 1e-6:
                problems.append(f"step {k + 1}: loss {logged[k]['loss']}, transformers {loss.item()} at ferry's weights")
            norm = logged[k]["grad_norm"]
            c = min(1.0, CLIP / (norm + 1e-6))
            bad = []
            for n, p in model.named_parameters():
                if n.endswith("self_attn.k_proj.bias") or n not in m_k:
                    continue  # (its analytic gradient is zero: see weights_error)
                before = m_prev[n] if m_prev else torch.zeros_like(m_k[n])
                g = (m_k[n] - BETA1 * before) / ((1 - BETA1) * c)
                e = ((g - p.grad).norm() / p.grad.norm().clamp_min(1e-30)).item()
                if e > 1e-4 and (g - p.grad).abs().max() > 1e-7:
                    bad.append((e, n))
            if bad and kink[0] > 1e-5:
                e, n = max(bad)
                problems.append(f"step {k + 1}: {len(bad)} gradients differ at ferry's weights, the worst {n}'s by {e:.2e}")
            elif bad:  # a ReLU input within rounding of zero: its side, and so the gradient, is a toss-up
                print(f"  {name}: step {k + 1}: gradients differ where a ReLU input is {kink[0]:.1e} of its "
                      f"layer's largest from zero (fp32 and float64 may see it on either side): passed")
        prev, m_prev = here, m_k
    return problems


def check_variant(torch, ferry, tmp, name, spec, toks, data):
    changes, dtype, shard = spec
    src = os.path.join(tmp, name)
    build(torch, name, changes, dtype, shard, src)
    dropout = changes.get("dropout", 0) > 0
    extra = ("--dropout", "config", "--seed", str(DROPOUT_SEED)) if dropout else ()
    mask = None
    if name == "loss_mask":
        os.makedirs(os.path.join(tmp, "masked"), exist_ok=True)
        data = os.path.join(tmp, "masked", "tokens.bin")
        write_shard(data)
        mask = write_mask(data, len(toks))
    return compare(torch, ferry, tmp, name, src, data, toks, dropout=dropout, mask=mask, extra=extra)


def loss_error(losses, ref):
    """The largest relative difference of two runs' step losses (steps without a loss skipped)."""
    return max([abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref) if a is not None and b is not None]
               or [0.0])


def weights_error(saved, ref, initial):
    """The largest normalised difference of two sets of weights (the worst tensor's name with it),
    and the tensors that break Adam's bound on k_proj's bias (whose analytic gradient is zero: a
    shift of every key moves no softmax, so Adam moves it by normalised rounding noise, different
    in every implementation: at most lr a step)."""
    err, worst, bad = 0.0, None, []
    for n in set(ref) & set(saved):
        a, b = saved[n].double(), ref[n].double()
        if a.shape != b.shape:
            continue
        if n.endswith("self_attn.k_proj.bias"):
            bound = 1.01 * LR * STEPS
            if ((a - initial[n]).abs().max() > bound) or ((b - initial[n]).abs().max() > bound):
                bad.append(n)
            continue
        e = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        if e > err:
            err, worst = e, n
    return err, worst, bad


def hf_eval(torch, path, toks, Be, T, batches, mask=None):
    """transformers' mean loss of the model at path over the first batches x Be windows of T + 1
    tokens in order (targets whose mask is 0 left out), as ferry eval takes them."""
    from transformers import OPTForCausalLM
    model = OPTForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for w in stream_windows(len(toks), T, batches * Be):
            ids = torch.tensor([toks[w * T:w * T + T + 1]], dtype=torch.long)
            logits = model(input_ids=ids, use_cache=False).logits[0, :T]
            ce = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            keep = [mask is None or mask[w * T + i] for i in range(1, T + 1)]
            total += sum(float(c) for c, k in zip(ce, keep) if k)
            count += sum(keep)
    return total / count if count else None


def ferry_eval(ferry, weights, data, T, how):
    """ferry eval's mean loss (None when no target counts) of the model at weights."""
    cmd = [*how["launch"], ferry, "eval", "--init", weights, "--data", data, "--seq", str(T), "--batch", str(how["batch"]),
           "--batches", str(how["batches"]), *how["extra"]]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ferry eval failed ({' '.join(cmd)}): " + (r.stderr or r.stdout).strip())
    words = r.stdout.split()
    value = words[words.index("loss") + 1].rstrip(":")
    return None if value in ("nan", "-nan") else float(value)


def compare(torch, ferry, tmp, name, src, data, toks, B=B, T=T, dropout=False, mask=None, extra=(), launch=(),
            report=None, runs=None, eps=EPS, evaluate=None, shuffle=None):
    """ferry (the command line extra, under launch) and transformers train the model at src on
    the shard data (tokens toks, loss mask mask) for STEPS steps of B x T tokens: the losses and
    the saved weights must agree (1e-5 relative, 1e-4 normalised). Random configurations include
    ill-conditioned ones (a hidden size of 2 leaves layer norm almost no gradient, which Adam
    scales up to full steps of rounding noise), where two fp32 runs may part further: then both
    are measured against transformers in float64 and ferry passes if it is within 4 times fp32
    transformers' own distance from it. Prints one JSON line (with report's fields); True when
    they agree."""
    from safetensors.torch import load_file
    save, log = (os.path.join(tmp, name + s) for s in (".saved", ".log"))
    problems = []
    try:
        ferry_losses, weights = ferry_runs(ferry, src, data, save, log,
                                           runs or [dict(extra=list(extra), launch=list(launch))], B, T, eps, shuffle)
    except RuntimeError as e:
        print(json.dumps({"variant": name, **(report or {}), "ok": False}))
        print(f"  {name}: {e}")
        return False
    hf_losses, model = hf_train(torch, src, toks, B, T, dropout, mask, eps=eps, shuffle=shuffle)
    if len(ferry_losses) != STEPS:
        problems.append(f"ferry logged {len(ferry_losses)} steps, not {STEPS}")
    if [a is None for a in ferry_losses] != [b is None for b in hf_losses]:
        problems.append(f"steps without a loss: ferry {ferry_losses}, transformers {hf_losses}")
    saved = {}
    for f in sorted(os.listdir(weights)):
        if f.endswith(".safetensors") and f != "optimizer.safetensors":
            saved.update(load_file(os.path.join(weights, f)))
    want = {n: p.detach() for n, p in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        want.pop("lm_head.weight", None)  # tied: a checkpoint holds only the embedding
    missing, unexpected = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
    if missing or unexpected:
        problems.append(f"saved tensor names: missing {missing}, unexpected {unexpected}")
    for n in set(want) & set(saved):
        if saved[n].shape != want[n].shape:
            problems.append(f"{n}: saved shape {tuple(saved[n].shape)}, transformers {tuple(want[n].shape)}")
    initial = {n: p.detach().double() for n, p in load_initial(torch, src).items()}
    loss_err = loss_error(ferry_losses, hf_losses)
    w_err, w_worst, k_bad = weights_error(saved, want, initial)
    fields = {"loss_rel_err": float(f"{loss_err:.3g}"), "weights_rel_err": float(f"{w_err:.3g}")}
    if loss_err > 1e-5 or w_err > 1e-4:
        ref_losses, ref_model = hf_train(torch, src, toks, B, T, dropout, mask, dtype="float64", eps=eps,
                                          shuffle=shuffle)
        ref = {n: p.detach() for n, p in ref_model.state_dict().items()}
        ferry64, fp32_64 = loss_error(ferry_losses, ref_losses), loss_error(hf_losses, ref_losses)
        wf64, wf_worst, _ = weights_error(saved, ref, initial)
        wt64, _, _ = weights_error(want, ref, initial)
        fields.update(float64={"ferry_loss": float(f"{ferry64:.3g}"), "transformers_loss": float(f"{fp32_64:.3g}"),
                               "ferry_weights": float(f"{wf64:.3g}"), "transformers_weights": float(f"{wt64:.3g}")})
        numeric = []
        if ferry64 > max(1e-5, 4 * fp32_64):
            numeric.append(f"losses differ by {loss_err:.2e} relative, from float64's by {ferry64:.2e} (fp32 "
                           f"transformers' by {fp32_64:.2e}): ferry {ferry_losses}, transformers {hf_losses}")
        if wf64 > max(1e-4, 4 * wt64):
            numeric.append(f"weights after {STEPS} steps differ by {w_err:.2e} (normalised), from float64's by "
                           f"{wf64:.2e} (worst {wf_worst}; fp32 transformers' by {wt64:.2e})")
        if numeric:  # trajectories that parted: every step checked from ferry's own weights decides
            steps = stepwise(torch, ferry, tmp, name, src, data, toks, B, T, dropout, mask,
                             runs or [dict(extra=list(extra), launch=list(launch))], eps, shuffle)
            fields["stepwise"] = "ok" if not steps else "FAILED"
            problems += numeric + steps if steps else []
    if k_bad:
        problems.append(f"{k_bad} moved more than Adam's bound of {1.01 * LR * STEPS}")
    last = (runs or [{}])[-1]
    if last.get("val_batches"):  # the validation after the last step: of the weights ferry saved
        lines = [json.loads(line) for line in open(f"{log}.{len(runs) - 1}") if line.strip()]
        got = lines[-1].get("val_loss") if lines else None
        want = hf_eval(torch, weights, toks, last["rows"], T, last["val_batches"], mask)
        fields["val_rel_err"] = None if got is None or want is None else float(f"{abs(got - want) / abs(want):.3g}")
        if (got is None) != (want is None) or (got is not None and abs(got - want) > 1e-5 * abs(want) + 1e-6):
            problems.append(f"validation after the last step: {got}, transformers {want}")
    if evaluate:  # ferry eval of the weights ferry saved, against transformers' loss of the same weights
        try:
            got = ferry_eval(ferry, weights, data, T, evaluate)
        except RuntimeError as e:
            got, problems = None, problems + [str(e)]
        want = hf_eval(torch, weights, toks, evaluate["batch"] * evaluate["ranks"], T, evaluate["batches"], mask)
        fields["eval_rel_err"] = None
        if (got is None) != (want is None):
            problems.append(f"eval loss {got}, transformers {want}")
        elif got is not None:
            fields["eval_rel_err"] = float(f"{abs(got - want) / abs(want):.3g}")
            if abs(got - want) > 1e-5 * abs(want) + 1e-6:
                problems.append(f"eval loss {got}, transformers {want}")
    print(json.dumps({"variant": name, **(report or {}), **fields, "ok": not problems}))
    for p in problems:
        print(f"  {name}: {p}")
    return not problems


# ---- random configurations, trained along random paths ----

def random_case(rnd, i, tmp, have_mpirun, gpu=0):
    """Case i of a random sweep: an OPT configuration drawn at random (odd sizes, every flag,
    either activation, dropout, weights in any dtype), random data with the pad id among its tokens
    and perhaps a loss mask, and a random way for ferry to train it that must not change the
    numbers: threads, micro-batches accumulated, recomputation, the sim device with its cache
    blocks, prefetch, device and disk chunks, or 2 ranks (data-parallel, chunk-sharded on sim,
    or tensor-parallel). Returns the keyword arguments of compare and the model to build."""
    NH, HS = rnd.randint(1, 4), rnd.choice([2, 3, 4, 5, 8])
    if NH * HS == 2:  # a layer norm over 2 values gives +-1 whatever its input: a gradient of rounding noise
        HS = 3
    hidden = NH * HS
    B, T = rnd.randint(1, 4), rnd.randint(1, 16)
    changes = dict(vocab_size=rnd.randint(8, 160), hidden_size=hidden, num_attention_heads=NH,
                   ffn_dim=rnd.randint(2, 48), num_hidden_layers=rnd.randint(1, 3),
                   max_position_embeddings=T + 1 + rnd.randint(0, 8),  # transformers reads T + 1 tokens
                   word_embed_proj_dim=hidden if rnd.random() < 0.6 else rnd.randint(2, 20),
                   do_layer_norm_before=rnd.random() < 0.6, enable_bias=rnd.random() < 0.8,
                   layer_norm_elementwise_affine=rnd.random() < 0.8, tie_word_embeddings=rnd.random() < 0.6,
                   _remove_final_layer_norm=rnd.random() < 0.2, activation_function=rnd.choice(["relu", "gelu"]),
                   dropout=0.0 if rnd.random() < 0.6 else round(rnd.uniform(0.05, 0.5), 2))
    dtype = rnd.choice(["float32", "float32", "bfloat16", "float16"])
    shard = rnd.choice([None, None, "8KB"])
    name = f"random{i}"
    d = os.path.join(tmp, name + ".data")
    os.makedirs(d, exist_ok=True)
    data = os.path.join(d, "tokens.bin")
    # Enough windows for every step, or (on some) fewer: the stream then wraps into a second epoch.
    n_windows = STEPS * B + 2 if rnd.random() < 0.7 else rnd.randint(B, 3 * B)
    toks = write_shard(data, n=n_windows * T + 1 + rnd.randint(0, T - 1), vocab=changes["vocab_size"], low=0,
                       seed=rnd.randrange(1 << 30))
    shuffle = DROPOUT_SEED if rnd.random() < 0.3 else None
    mask = write_mask(data, len(toks), seed=rnd.randrange(1 << 30)) if rnd.random() < 0.3 else None

    # How ferry trains it: one way, or one way up to a checkpoint and perhaps another from there.
    run = draw_path(rnd, tmp, name, B, NH, changes["ffn_dim"], have_mpirun, gpu)
    runs = [run]
    if rnd.random() < 0.25:
        runs = [dict(run, stop_after=rnd.randint(1, STEPS - 1)),
                draw_path(rnd, tmp, name + ".resumed", B, NH, changes["ffn_dim"], have_mpirun, gpu)]
    for r in runs:
        if changes["dropout"] > 0:
            r["extra"] += ["--dropout", "config", "--seed", str(DROPOUT_SEED)]
    # Validation while training (its last is of the saved weights): the training data's first batches
    last = runs[-1]
    if last["rows"] and rnd.random() < 0.3:
        last["val_batches"] = rnd.randint(1, 3)
        last["extra"] += ["--val-data", data, "--val-every", str(rnd.randint(1, STEPS)),
                          "--val-batches", str(last["val_batches"])]
    # ferry eval of the trained weights: some batches in order, on the cpu or offloaded, 1 to 3 ranks
    evaluate = None
    if rnd.random() < 0.5:
        Be, ranks = rnd.randint(1, 3), rnd.choice([1, 1, 2])
        nw = (len(toks) - 1) // T  # (ferry refuses data with fewer windows than a batch)
        ranks = ranks if nw >= ranks else 1
        Be = min(Be, nw // ranks)
        evaluate = dict(batch=Be, ranks=1, batches=rnd.randint(1, 3), extra=["--threads", "1"], launch=[])
        if ranks > 1 and have_mpirun and (not gpu or gpu >= 2):  # (each rank takes Be of a batch's Be x ranks windows)
            evaluate.update(ranks=ranks, launch=["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks)])
        if gpu:  # (several ranks on GPUs: offloaded, chunk-sharded)
            offload = rnd.random() < 0.5 or evaluate["ranks"] > 1
            evaluate["extra"] += ["--device", "cuda", "--precision", "fp32"] + (["--offload"] if offload else [])
        elif rnd.random() < 0.4:
            evaluate["extra"] += ["--device", "sim", "--device-mem", "4MiB"]
    report = dict(config={k: v for k, v in changes.items() if k != "max_position_embeddings"}, dtype=dtype,
                  B=B, T=T, mask=mask is not None, windows=(len(toks) - 1) // T, shuffle=shuffle is not None,
                  runs=[" ".join(r["launch"] + ["ferry", "train"] + r["extra"]) +
                        (f" --stop-after {r['stop_after']}" if "stop_after" in r else "") for r in runs],
                  eval=evaluate and " ".join(evaluate["launch"] + ["ferry", "eval"] + evaluate["extra"]) +
                  f" --batch {evaluate['batch']} --batches {evaluate['batches']}")
    return dict(name=name, changes=changes, dtype=dtype, shard=shard, data=data, toks=toks, B=B, T=T,
                dropout=changes["dropout"] > 0, mask=mask, runs=runs, evaluate=evaluate, shuffle=shuffle, report=report)


def draw_ranks(rnd, micro, NH, ffn, extra, most):
    """Three times in ten, a dp x tp grid of at most `most` ranks (2 or 3 data-parallel, --tp 2, or
    2 x 2) that divides the micro-batch of `micro` sequences; its --tp goes into extra (whose
    --threads becomes 1). Returns dp, tp, the mpirun launch ([] for one rank) and each
    data-parallel rank's micro-batch."""
    if rnd.random() >= 0.3:
        return 1, 1, [], micro
    can_tp = NH % 2 == 0 and ffn % 2 == 0
    grids = [(dp, tp) for dp, tp in ((2, 1), (3, 1), (1, 2), (2, 2))
             if dp * tp <= most and micro % dp == 0 and (tp == 1 or can_tp)]
    if not grids:
        return 1, 1, [], micro
    dp, tp = rnd.choice(grids)
    extra[1] = "1"
    if tp > 1:
        extra += ["--tp", str(tp)]
    return dp, tp, ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(dp * tp)], micro // dp


def draw_path(rnd, tmp, name, B, NH, ffn, have_mpirun, gpu=0):
    """A random way to train B sequences a step that must give the numbers of any other: threads,
    micro-batches accumulated, 2 to 4 ranks (data-parallel, chunk-sharded on sim, tensor-parallel),
    recomputation, the cpu or the sim device (its cache blocks, prefetch, chunks kept on the
    device, AdamW state on disk, or the planner's choice); with gpu, the cuda device in fp32,
    resident or offloaded (cache blocks, prefetch, chunks kept on the device)."""
    extra, launch, micro = ["--threads", str(rnd.choice([1, 2]))], [], B
    if B % 2 == 0 and rnd.random() < 0.3:
        micro //= 2
        extra += ["--grad-accum", "2"]
    rows = micro  # the sequences of a micro-batch over every data-parallel rank (a validation batch)
    if gpu:
        # (with 2 GPUs or more: 2 to 4 ranks, one GPU each, data-parallel (resident replicas, or
        # offloaded and chunk-sharded, every shard in pinned host memory), tensor-parallel
        # (offloaded, or alone without --offload: its slices on the GPUs) or both; with one, the
        # draws of the cases before ranks existed)
        dp = tp = 1
        if gpu >= 2 and have_mpirun:
            dp, tp, launch, micro = draw_ranks(rnd, micro, NH, ffn, extra, gpu)
        extra += ["--device", "cuda", "--precision", "fp32", "--batch", str(micro)]
        if rnd.random() < 0.4:
            extra.append("--recompute")
        # (data-parallel ranks without --offload: replicas; a grid needs it)
        if (tp > 1 and (dp > 1 or rnd.random() < 0.5)) or (tp == 1 and rnd.random() < 0.5):
            extra += ["--offload", "--device-mem", "256MiB", "--blocks", str(rnd.randint(1, 4)),
                      "--prefetch", str(rnd.randint(0, 2)), "--device-chunks", str(0 if dp > 1 else rnd.choice([0, 0, 1, 2]))]
        return dict(extra=extra, launch=launch, rows=rows)
    if have_mpirun:
        _, _, launch, micro = draw_ranks(rnd, micro, NH, ffn, extra, 4)
    if rnd.random() < 0.4:
        extra.append("--recompute")
    if rnd.random() < 0.1 and not launch:  # the planner's choice of micro-batches, chunks, blocks, recomputation
        extra += ["--device", "sim", "--device-mem", rnd.choice(["2MiB", "8MiB", "64MiB"]), "--plan", "auto"]
    elif rnd.random() < 0.35:
        # (several ranks keep all their shards on the device or none: 1000 is "all")
        chunks = rnd.choice([0, 0, 1000] if launch else [0, 0, 1, 2])
        extra += ["--device", "sim", "--blocks", str(rnd.randint(1, 4)), "--prefetch", str(rnd.randint(0, 2)),
                  "--device-chunks", str(chunks)]
        if chunks == 0 and rnd.random() < 0.4:  # (a tiny model may have a single chunk)
            disk = os.path.join(tmp, name + ".disk")
            os.makedirs(disk, exist_ok=True)
            extra += ["--disk-dir", disk, "--disk-chunks", "1"]
    extra += ["--batch", str(micro)]
    return dict(extra=extra, launch=launch, rows=None if "--plan" in extra else rows)


def check_random(torch, ferry, tmp, n, seed, only=None, gpu=0):
    import random
    import shutil
    rnd = random.Random(seed)
    have_mpirun = shutil.which("mpirun") is not None
    ok = True
    for i in range(n):
        c = random_case(rnd, i, tmp, have_mpirun, gpu)
        model_seed = rnd.randrange(1 << 30)
        if only is not None and i != only:
            continue
        src = os.path.join(tmp, c["name"])
        build(torch, c["name"], c["changes"], c["dtype"], c["shard"], src, seed=model_seed)
        ok = compare(torch, ferry, tmp, c["name"], src, c["data"], c["toks"], c["B"], c["T"], c["dropout"], c["mask"],
                     report=c["report"], runs=c["runs"], eps=RANDOM_EPS, evaluate=c["evaluate"],
                     shuffle=c["shuffle"]) and ok
    return ok


def check_placements(torch, ferry, tmp, n, seed, only=None):
    """Placement changes memory, never numbers (docs/design.md's correctness rule), bit for bit: each of
    n random cases (random_case's configurations and data) trains on the cpu and again on the sim
    device along a random placement (cache blocks, prefetch, chunks kept on the device, AdamW state
    on disk, recomputation), in fp32, bf16 or fp16 (rounded at every op; fp16 with its dynamic
    loss scale), and the two must log the same losses and save the same bytes. No reference
    library takes part: this is ferry against itself, where transformers cannot follow 16-bit
    rounding op by op."""
    import random
    from safetensors.torch import load_file
    rnd = random.Random(seed)
    ok = True
    for i in range(n):
        c = random_case(rnd, i, tmp, False)
        model_seed = rnd.randrange(1 << 30)
        precision = rnd.choice(["fp32", "bf16", "fp16"])
        base = ["--threads", "2", "--precision", precision, "--batch", str(c["B"])]
        if c["dropout"]:
            base += ["--dropout", "config", "--seed", str(DROPOUT_SEED)]
        placed = base + ["--device", "sim", "--blocks", str(rnd.randint(1, 4)), "--prefetch", str(rnd.randint(0, 2))]
        if rnd.random() < 0.4:
            placed.append("--recompute")
        chunks = rnd.choice([0, 0, 1, 2])
        placed += ["--device-chunks", str(chunks)]
        if chunks == 0 and rnd.random() < 0.4:
            disk = os.path.join(tmp, c["name"] + ".pdisk")
            os.makedirs(disk, exist_ok=True)
            placed += ["--disk-dir", disk, "--disk-chunks", "1"]
        if only is not None and i != only:
            continue
        src = os.path.join(tmp, c["name"])
        build(torch, c["name"], c["changes"], c["dtype"], c["shard"], src, seed=model_seed)
        out, problems = [], []
        for k, extra in enumerate((base, placed)):
            name = f"{c['name']}.{('cpu', 'sim')[k]}"
            save, log = os.path.join(tmp, name + ".saved"), os.path.join(tmp, name + ".log")
            try:
                losses, weights = ferry_runs(ferry, src, c["data"], save, log, [dict(extra=extra, launch=[])], c["B"],
                                             c["T"], RANDOM_EPS, c["shuffle"])
            except RuntimeError as e:
                problems.append(str(e))
                break
            out.append((losses, load_file(os.path.join(weights, "model.safetensors"))))
        if len(out) == 2:
            if out[0][0] != out[1][0]:
                problems.append(f"losses: cpu {out[0][0]}, sim {out[1][0]}")
            differ = [t for t in out[0][1] if not torch.equal(out[0][1][t], out[1][1].get(t, torch.empty(0)))]
            if differ:
                problems.append(f"{len(differ)} tensors differ, e.g. {differ[0]}")
        print(json.dumps({"variant": c["name"], "precision": precision, "config": c["report"]["config"],
                          "sim": " ".join(placed), "ok": not problems}))
        for p in problems:
            print(f"  {c['name']}: {p}")
        ok = ok and not problems
    return ok


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
    ap.add_argument("--random", type=int, metavar="N", help="instead: N random configurations and ways to train them")
    ap.add_argument("--seed", type=int, default=1, help="of the random configurations (default 1)")
    ap.add_argument("--case", type=int, metavar="I", help="with --random: only case I of the N")
    ap.add_argument("--gpu", action="store_true", help="with --random: ferry trains and evaluates on --device cuda (fp32)")
    ap.add_argument("--gpus", type=int, default=1, metavar="N",
                    help="with --gpu: the GPUs this machine has (default 1); from 2, some cases train and evaluate "
                         "on 2 or 3 ranks, one GPU each (mpirun)")
    ap.add_argument("--placements", type=int, metavar="N",
                    help="instead: N random cases trained on the cpu and on a random sim placement (fp32, bf16 "
                         "or fp16), which must agree bit for bit")
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
        if args.placements:
            ok = check_placements(torch, args.ferry, tmp, args.placements, args.seed, args.case)
            print(f"placements (seed {args.seed}):", "all passed" if ok else "FAILED")
            return 0 if ok else 1
        if args.random:
            ok = check_random(torch, args.ferry, tmp, args.random, args.seed, args.case, args.gpus if args.gpu else 0)
            print(f"random configurations (seed {args.seed}):", "all passed" if ok else "FAILED")
            return 0 if ok else 1
        data = os.path.join(tmp, "tokens.bin")
        toks = write_shard(data)
        ok = all([check_variant(torch, args.ferry, tmp, n, VARIANTS[n], toks, data) for n in names])
        if not args.only:
            ok = check_refused(torch, args.ferry, tmp, data) and ok
    print("variants:", "all passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
