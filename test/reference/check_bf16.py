#!/usr/bin/env python3
"""ferry's bf16 training on the cpu against an independent bf16 run in PyTorch.

For each fixture model (test/reference/pre_ln, post_ln), ferry trains STEPS steps with
`--device cpu --precision bf16` (docs/training.md: the weights, activations and gradients rounded
to bfloat16 at every operator; fp32 master weights, fp32 AdamW state and update). PyTorch trains
the same model on the same batches the way a PyTorch user trains in bf16 with fp32 master
weights: transformers' OPTForCausalLM holding bfloat16 parameters (a rounded copy of the fp32
masters, made afresh each step) runs forward and backward in bfloat16 tensors, its gradients are
taken into the fp32 masters, and torch's own clip_grad_norm_ and AdamW step the masters in fp32.
The loss is taken in fp32 from the bf16 logits, as transformers' own loss does.

No ferry code takes part on the PyTorch side. The two do not round at the same places (eager
attention in transformers rounds the scaled queries, the scores, the masked scores, the
probabilities; ferry's attention rounds its output once), so they cannot agree bit for bit; they
must agree within what bf16's rounding allows (the tolerances below, derived from its unit
roundoff), and the loss must fall.

Checked for each model, with tolerances derived below from bf16's unit roundoff and the number
of roundings and steps:
  1. every step's loss within loss_rtol(k) (relative) of PyTorch's;
  2. every final weight tensor (ferry saves its fp32 masters) within rho of what moved it in
     PyTorch's run, k_proj's bias within AdamW's bound (it has no gradient but rounding noise);
  3. the loss falls: the mean of the last 5 steps' losses at most FALL x the first step's, in both.
One JSON line a model gives the worst step's and the worst tensor's share of their tolerance.

usage: test/reference/check_bf16.py path/to/ferry [--keep DIR] [--seed S]
Exit status 0 when both models pass, 1 otherwise. Needs torch, transformers, safetensors.
"""

import argparse
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("pre_ln", "post_ln")
B, T, STEPS = 32, 24, 20
LR, BETA1, BETA2, EPS, WEIGHT_DECAY, CLIP = 3e-3, 0.9, 0.95, 1e-8, 0.1, 1.0

# ---- tolerances from bf16's rounding ----
#
# bfloat16 keeps 8 significant bits: rounding to nearest errs by at most u = 2^-8 of the value.
U = 2.0 ** -8
# Rounding errors of different operators do not line up: after n roundings a value's relative
# error is a random walk of about u * sqrt(n) (u * n is the worst case of errors all of one sign,
# which rounding to nearest does not produce). Each side walks its own way, so their difference
# is sqrt(2) of one walk; SIGMAS standard deviations of headroom.
SIGMAS = 4.0


def roundings(cfg):
    """Roundings on the longest forward path of the side that rounds most (transformers' eager
    OPT in bf16), and on forward and backward together. A decoder layer: q_proj, q * scale,
    q k^T, + mask, softmax to bf16, p v, out_proj, residual add, fc1, fc2, residual add, and its
    two layer norms (ReLU is exact): 13. Outside the layers: the embedding + positions add,
    lm_head, project_in and project_out where the model has them, the final layer norm where it
    has one. Backward retraces the path, each operator's input gradient rounded once: twice the
    forward's."""
    proj = cfg["word_embed_proj_dim"] != cfg["hidden_size"]
    final_ln = cfg["do_layer_norm_before"] and not cfg.get("_remove_final_layer_norm", False)
    n_fwd = 13 * cfg["num_hidden_layers"] + 2 + 2 * proj + final_ln
    return n_fwd, 2 * n_fwd


def loss_rtol(n_fwd, n_fwd_bwd, k):
    """1. Step k's loss (relative). It is the end of a chain of roundings: its own forward's, and
    through the weights they set, the forward and backward of each of the k steps before it. It
    is the mean over B * T tokens whose rounding errors are independent, which divides the walk
    by sqrt(B * T)."""
    return SIGMAS * math.sqrt(2) * U * math.sqrt(n_fwd + k * n_fwd_bwd) / math.sqrt(B * T)


def weight_rho(n_fwd_bwd):
    """2. The final weights, each tensor: ||ferry - PyTorch|| <= rho * M, M what moved the tensor
    in PyTorch's run. A gradient element carries the forward's and the backward's roundings,
    u * sqrt(n_fwd_bwd) relative. AdamW's step m^ / (sqrt(v^) + eps) does not see the gradients'
    scale, so a step's relative error is the gradient's, and the run's is the same fraction of
    what the steps moved: their sum where they agree (the net movement; an error that persists
    through the later steps, as a weight that parted early does, grows with it), the root of the
    sum of their squares where they do not (a tensor whose gradient is mostly noise walks at
    random, and each step's error is its own). M = sqrt(||final - initial||^2 + sum over the
    steps of ||step||^2) covers both.

    Left out: a ReLU input within rounding of zero lies on opposite sides of it in the two runs,
    and its token's whole share of fc1's gradient row differs. Such inputs are a few percent of
    them (about 2 * phi(0) * sqrt(2) * u * sqrt(n_fwd) = 2.4%), and their effect on a row falls
    as 1 / sqrt(B * T) against the part of the row that the tokens agree on, hence B * T = 768
    tokens a step: with 384, fc1's bias of one data draw in 16 (--seed 10, post_ln) parted by
    1.35 rho."""
    return SIGMAS * math.sqrt(2) * U * math.sqrt(n_fwd_bwd)


def adam_bound():
    """k_proj's bias has no gradient in exact arithmetic (a shift of every key moves no softmax
    row): its gradient is rounding noise, different on each side, and AdamW turns noise into
    steps. It is held to AdamW's bound instead, on each side: a step moves a weight by at most
    lr * max |m^ / sqrt(v^)|, which Cauchy-Schwarz bounds at step t by
    (1 - b1) / sqrt(1 - b2) * sqrt(sum_{i<t} (b1^2 / b2)^i) * sqrt(1 - b2^t) / (1 - b1^t)
    (1 at the first step, about 1.16 later with b1 0.9, b2 0.95)."""
    r = BETA1 * BETA1 / BETA2
    return LR * sum((1 - BETA1) / math.sqrt(1 - BETA2) * math.sqrt(sum(r ** i for i in range(t))) *
                    math.sqrt(1 - BETA2 ** t) / (1 - BETA1 ** t) for t in range(1, STEPS + 1))


# 3. The loss must fall: the data is a Markov chain the model can learn (markov_tokens), and the
# mean of the last 5 steps' losses must be at most FALL of the first step's, on both sides. One
# batch's loss spreads around the model's by 0.1% to 1.7% of it here (the per-token losses'
# standard deviation over sqrt(B * T), at the first and at the last weights), the mean of 5 by
# under half that: 5% is a fall, not a lucky draw.
FALL = 0.95


def markov_tokens(n, low, vocab, seed):
    """n tokens of a chain with a fixed successor for each token (probability 0.8; else uniform)
    over [low, vocab): something a 2-layer model learns in a few dozen steps."""
    rnd = random.Random(seed)
    succ = {t: rnd.randrange(low, vocab) for t in range(low, vocab)}
    toks = [rnd.randrange(low, vocab)]
    while len(toks) < n:
        toks.append(succ[toks[-1]] if rnd.random() < 0.8 else rnd.randrange(low, vocab))
    return toks


def write_shard(path, toks):
    """A ferry token shard (runtime/data.h): 256 int32 header words (magic, version, count), then
    uint16 tokens."""
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)))
        f.write(struct.pack("<%dH" % len(toks), *toks))


def batch_ids(torch, toks, k):
    """Step k's (B, T + 1) windows as ferry's loader takes them without shuffling: row j is window
    w = kB + j, tokens [wT, wT + T] (the T + 1 give T inputs and their T next tokens)."""
    rows = [toks[w * T:w * T + T + 1] for w in range(k * B, k * B + B)]
    return torch.tensor(rows, dtype=torch.long)


def ferry_train(ferry, model_dir, data, out, log):
    cmd = [ferry, "train", "--init", model_dir, "--data", data, "--device", "cpu", "--precision", "bf16",
           "--batch", str(B), "--seq", str(T), "--steps", str(STEPS), "--lr", repr(LR), "--min-lr", repr(LR),
           "--warmup", "0", "--weight-decay", repr(WEIGHT_DECAY), "--beta1", repr(BETA1), "--beta2", repr(BETA2),
           "--eps", repr(EPS), "--clip", repr(CLIP), "--no-shuffle", "--threads", "1", "--quiet", "--log", log,
           "--save", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ferry train failed ({' '.join(cmd)}): " + (r.stderr or r.stdout).strip())
    return [json.loads(line)["loss"] for line in open(log) if line.strip()]


def torch_train(torch, model_dir, toks):
    """bf16 compute, fp32 master weights and AdamW: each step the bf16 model gets the masters
    rounded to bf16, runs forward and backward in bf16, and its gradients (bf16) become the
    masters' (fp32) for clipping and the update. Returns the step losses, the final masters and,
    for each tensor, the sum over the steps of the squared norm of what its step moved it."""
    from transformers import OPTForCausalLM
    master = OPTForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    work = OPTForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    master.train()
    work.train()
    m_params = dict(master.named_parameters())
    w_params = dict(work.named_parameters())  # (the tied lm_head is embed_tokens: one parameter)
    assert m_params.keys() == w_params.keys()
    groups = [dict(params=[p for p in m_params.values() if p.ndim >= 2], weight_decay=WEIGHT_DECAY),
              dict(params=[p for p in m_params.values() if p.ndim < 2], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(BETA1, BETA2), eps=EPS)
    losses, steps_sq = [], {}  # steps_sq: each tensor's sum over the steps of its step's squared norm
    for k in range(STEPS):
        ids = batch_ids(torch, toks, k)
        with torch.no_grad():
            for n, p in w_params.items():
                p.copy_(m_params[n])  # rounds to nearest even
        work.zero_grad(set_to_none=True)
        logits = work(input_ids=ids, use_cache=False).logits
        V = logits.shape[-1]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1))
        loss.backward()
        for n, p in m_params.items():
            p.grad = w_params[n].grad.float()
        torch.nn.utils.clip_grad_norm_(master.parameters(), CLIP)
        before = {n: p.detach().clone() for n, p in m_params.items()}
        opt.step()
        for n, p in m_params.items():
            steps_sq[n] = steps_sq.get(n, 0.0) + (p.detach().double() - before[n].double()).square().sum().item()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in master.state_dict().items()}, steps_sq


def check_model(torch, ferry, tmp, name, seed):
    from safetensors.torch import load_file
    model_dir = os.path.join(HERE, name)
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    n_fwd, n_fwd_bwd = roundings(cfg)
    toks = markov_tokens(STEPS * B * T + 1, 3, cfg["vocab_size"], seed=sum(map(ord, name)) + seed)
    data = os.path.join(tmp, name + ".bin")
    write_shard(data, toks)
    out, log = os.path.join(tmp, name + ".out"), os.path.join(tmp, name + ".jsonl")
    f_losses = ferry_train(ferry, model_dir, data, out, log)
    t_losses, t_final, t_steps_sq = torch_train(torch, model_dir, toks)
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    f_final = load_file(os.path.join(out, "model.safetensors"))
    problems = []
    if len(f_losses) != STEPS or None in f_losses:
        problems.append(f"ferry logged {f_losses}, not {STEPS} losses")
        f_losses = [math.nan] * STEPS
    # 1. the losses, step by step: the worst step by its share of its tolerance
    loss_share, loss_at = 0.0, 0
    for k, (a, b) in enumerate(zip(f_losses, t_losses)):
        share = abs(a - b) / abs(b) / loss_rtol(n_fwd, n_fwd_bwd, k)
        if not share <= loss_share:
            loss_share, loss_at = share, k
    if not loss_share <= 1:
        k = loss_at
        problems.append(f"step {k}'s loss: ferry {f_losses[k]:.6f}, PyTorch {t_losses[k]:.6f}: "
                        f"{abs(f_losses[k] - t_losses[k]) / t_losses[k]:.3g} relative > "
                        f"{loss_rtol(n_fwd, n_fwd_bwd, k):.3g}")
    # 2. the final weights, tensor by tensor
    rho, bound = weight_rho(n_fwd_bwd), adam_bound()
    w_worst = (0.0, None, 0.0, 0.0)  # (share of rho, name, relative error, its tolerance)
    k_moved = 0.0
    for n, b in t_final.items():
        if n == "lm_head.weight" and cfg.get("tie_word_embeddings", True):
            continue  # (embed_tokens)
        if n not in f_final or f_final[n].shape != b.shape:
            problems.append(f"ferry saved no {n} of shape {tuple(b.shape)}")
            continue
        a, b, w0 = f_final[n].double(), b.double(), initial[n].double()
        if n.endswith("self_attn.k_proj.bias"):
            for side, w in (("ferry", a), ("PyTorch", b)):
                moved = (w - w0).abs().max().item()
                k_moved = max(k_moved, moved)
                if not moved <= bound:
                    problems.append(f"{n} moved {moved:.3g} in {side}, beyond AdamW's bound {bound:.3g}")
            continue
        diff, moved = (a - b).norm().item(), math.sqrt((b - w0).square().sum().item() + t_steps_sq[n])
        if not diff <= rho * moved:
            problems.append(f"final {n}: ||ferry - PyTorch|| {diff:.3g} > {rho:.3g} x {moved:.3g} (what moved it)")
        share = diff / (rho * moved) if moved > 0 else math.inf
        if not share <= w_worst[0]:
            w_worst = (share, n, diff / b.norm().item(), rho * moved / b.norm().item())
    extra = sorted(set(f_final) - set(t_final))
    if extra:
        problems.append(f"ferry saved tensors transformers does not have: {extra}")
    # 3. the loss falls
    fell = {}
    for side, ls in (("ferry", f_losses), ("PyTorch", t_losses)):
        fell[side] = sum(ls[-5:]) / 5 / ls[0]
        if not fell[side] <= FALL:
            problems.append(f"{side}'s loss did not fall: first {ls[0]:.4f}, mean of the last 5 "
                            f"{sum(ls[-5:]) / 5:.4f} (> {FALL} x the first)")
    g = lambda x: float(f"{x:.3g}")
    print(json.dumps({"model": name, "steps": STEPS, "batch": [B, T], "roundings": [n_fwd, n_fwd_bwd],
                      "loss": {"ferry": [round(f_losses[0], 5), round(f_losses[-1], 5)],
                               "pytorch": [round(t_losses[0], 5), round(t_losses[-1], 5)],
                               "worst_step": loss_at, "share_of_tol": g(loss_share)},
                      "weights": {"rho": g(rho), "worst": w_worst[1], "share_of_tol": g(w_worst[0]),
                                  "rel_err": g(w_worst[2]), "rel_tol": g(w_worst[3]),
                                  "k_proj_bias_moved": g(k_moved), "adam_bound": g(bound)},
                      "fall": {k: round(v, 4) for k, v in fell.items()}, "ok": not problems}))
    for p in problems:
        print(f"  {name}: {p}")
    return not problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ferry")
    ap.add_argument("--keep", metavar="DIR", help="write the data, logs and saved weights in DIR and keep them")
    ap.add_argument("--seed", type=int, default=0, help="another draw of the data (default 0)")
    args = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    torch.set_num_threads(1)  # (models this small gain nothing from more, and a busy machine loses)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        os.makedirs(tmp, exist_ok=True)
        ok = all([check_model(torch, args.ferry, tmp, n, args.seed) for n in MODELS])
    print("bf16 against PyTorch:", "all passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
