#!/usr/bin/env python3
"""A mixture-of-experts OPT model trained by ferry and by PyTorch side by side (issue 37).

transformers has no OPT-MoE class, so the reference is written here: transformers' OPT decoder for
the dense parts (attention, layer norms, dense feed-forwards, embeddings), and in the layers that
config.json makes mixtures (layer l when (l + 1) % moe_layer_frequency == 0) a block written below
with torch ops alone, ferry's code nowhere: a linear router without bias, softmax over the experts,
torch.topk, the chosen probabilities renormalised, every routed token computed by its experts
(each an OPT feed-forward fc1, activation, fc2), the outputs summed with the weights; and the
Switch/Mixtral load-balancing term E * sum_e f_e P_e (f_e: the token-choices routed to e over the
tokens, each of the k choices counted; P_e: e's mean router probability) of every mixture layer,
times router_aux_loss_coef, added to the mean cross-entropy. The experts' weights are stacked as
ferry stores them (expert e's fc1 is rows [e F, (e + 1) F) of experts.fc1.weight), so that an
expert without a token has a zero gradient in both, and AdamW decays it the same.

For each case a random model is written as ferry's checkpoint (config.json with the mixture's keys,
model.safetensors), then:
  1. ferry trains it STEPS steps on the cpu (constant learning rate, clipping, weight decay, batches
     in order) and PyTorch trains it with torch.optim.AdamW on the same sequences: every step's
     loss within 1e-5 relative, and ferry's logged aux_loss with it;
  2. the weights ferry saves equal PyTorch's after the same steps, each tensor's normalised error
     within 1e-4, and after one step too.
The "upcycle" case starts a mixture from a dense transformers checkpoint (ferry train --init DENSE
--model MOE_DIR): at learning rate 0 the saved experts are exact copies of the dense feed-forwards,
and the first step's loss is transformers' dense loss (a mixture of identical experts, weights
summing to 1, is the dense block) within 1e-5; then 5 steps of it against the reference started
from those weights.
The "ranks" case (where mpirun is installed) trains opt-moe-tiny on 2 ranks of one micro-batch each
and on one rank accumulating the same two micro-batches: the same losses, aux_loss and weights,
bit for bit (the balance term is a micro-batch's, so the micro-batches must be the same).
The "starved" case sets one expert's router row so that no token ever picks it (the layer norm's
bias pushes every input along the row, which points the other way): the check asserts it got no
token in any step, and its weights then moved by the weight decay alone, in both.
The "padded" case is the tokens dropped to no expert by masking: a batch whose second sequence
ends in 5 padding tokens (attention mask 0, pad token id, labels -100; ferry's training data never
pads, its engine takes such batches as transformers does) and two real tokens whose loss is masked
(labels -100). Padding goes to no expert, as if every router logit of it were masked: the block's
output there is 0, so the layer passes the residual alone, and the balance term's f_e and P_e are
over the routed tokens (Mixtral's load-balancing loss with an attention mask); loss-masked real
tokens are routed like any other (later tokens attend to them). The reference written below takes
the mask; the case writes a fixture in test/test_reference.c's format (the batch, the logits and
loss, every gradient of loss + aux_loss, 5 AdamW steps' losses, norms and weights) and runs
build/test/test_reference on it: logits and loss within 1e-5, gradients and weights within 1e-4.

usage: test/reference/check_moe.py path/to/ferry [--only NAME] [--keep DIR]
(the "padded" case runs test/test_reference from the same build directory as ferry)
Exit status 0 when every case passes, 1 otherwise. Needs torch, transformers, safetensors.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from check_variants import write_shard  # (the same token shard writer, llm.c's format)

B, T, STEPS = 2, 12, 5
LR, BETA1, BETA2, EPS, WEIGHT_DECAY, CLIP = 1e-2, 0.9, 0.95, 1e-8, 0.1, 1.0
VOCAB = 67

BASE = dict(vocab_size=VOCAB, hidden_size=24, num_attention_heads=3, ffn_dim=40, num_hidden_layers=4,
            max_position_embeddings=32, word_embed_proj_dim=24, do_layer_norm_before=True, dropout=0.0,
            attention_dropout=0.0, layerdrop=0.0, activation_function="relu", enable_bias=True)
MOE = dict(num_local_experts=4, num_experts_per_tok=2, moe_layer_frequency=2, router_aux_loss_coef=0.05)

# name: (config changes, mixture changes, starve: (layer, expert) no token may reach)
CASES = {
    "base": ({}, {}, None),
    "gelu_no_bias_every_layer_top1": (dict(activation_function="gelu", enable_bias=False),
                                      dict(moe_layer_frequency=1, num_experts_per_tok=1, num_local_experts=3), None),
    "post_ln_top3_of_5": (dict(do_layer_norm_before=False), dict(num_local_experts=5, num_experts_per_tok=3), None),
    "starved": ({}, {}, (1, 3)),
}


def moe_layers(cfg):
    return [l for l in range(cfg["num_hidden_layers"]) if (l + 1) % cfg["moe_layer_frequency"] == 0]


class MoE:
    """The reference block; make() returns a torch.nn.Module (torch imported late)."""

    @staticmethod
    def make(torch, cfg):
        D, F = cfg["hidden_size"], cfg["ffn_dim"]
        E, K, bias = cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["enable_bias"]
        act = torch.nn.functional.gelu if cfg["activation_function"] == "gelu" else torch.relu

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.gate = torch.nn.Parameter(torch.zeros(E, D))
                self.w1 = torch.nn.Parameter(torch.zeros(E * F, D))
                self.b1 = torch.nn.Parameter(torch.zeros(E * F)) if bias else None
                self.w2 = torch.nn.Parameter(torch.zeros(E * D, F))
                self.b2 = torch.nn.Parameter(torch.zeros(E * D)) if bias else None
                self.balance = None
                self.counts = None
                self.mask = None  # (N,) bool: False for padding, which goes to no expert

            def forward(self, x):  # x (N, D): every token of the batch
                N = x.shape[0]
                keep = self.mask if self.mask is not None else torch.ones(N, dtype=torch.bool)
                probs = torch.softmax(x @ self.gate.t(), dim=-1)
                top_p, top_i = torch.topk(probs, K, dim=-1)
                weights = top_p / top_p.sum(dim=-1, keepdim=True)
                out = torch.zeros_like(x)
                counts = []
                for e in range(E):
                    tok, j = ((top_i == e) & keep.unsqueeze(1)).nonzero(as_tuple=True)
                    counts.append(len(tok))
                    if len(tok) == 0:
                        continue
                    h = x[tok] @ self.w1[e * F:(e + 1) * F].t()
                    if bias:
                        h = h + self.b1[e * F:(e + 1) * F]
                    y = act(h) @ self.w2[e * D:(e + 1) * D].t()
                    if bias:
                        y = y + self.b2[e * D:(e + 1) * D]
                    out = out.index_add(0, tok, weights[tok, j].unsqueeze(1) * y)
                # f and P over the routed tokens (padding left out, as Mixtral's attention mask does)
                routed = int(keep.sum())
                f = torch.tensor(counts, dtype=x.dtype) / max(routed, 1)
                self.balance = E * (f * probs[keep].mean(dim=0)).sum() if routed else x.new_zeros(())
                self.counts = counts
                return out

        return Block()


def ferry_names(l):
    p = f"model.decoder.layers.{l}.block_sparse_moe."
    return dict(gate=p + "gate.weight", w1=p + "experts.fc1.weight", b1=p + "experts.fc1.bias",
                w2=p + "experts.fc2.weight", b2=p + "experts.fc2.bias")


def build(torch, name, cfg, starve, outdir):
    """A random model in ferry's checkpoint format; returns its state dict."""
    from safetensors.torch import save_file
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(sum(map(ord, name)))
    dense = OPTForCausalLM(OPTConfig(**{k: v for k, v in cfg.items() if k not in MOE}))
    state = {}
    for n, p in dense.state_dict().items():
        if n == "lm_head.weight" or any(f"layers.{l}.fc" in n for l in moe_layers(cfg)):
            continue
        one = 1.0 if "layer_norm" in n and n.endswith(".weight") else 0.0
        state[n] = (one + 0.1 * torch.randn(p.shape)).contiguous()
    D, F, E = cfg["hidden_size"], cfg["ffn_dim"], cfg["num_local_experts"]
    shapes = dict(gate=(E, D), w1=(E * F, D), b1=(E * F,), w2=(E * D, F), b2=(E * D,))
    for l in moe_layers(cfg):
        for k, n in ferry_names(l).items():
            if k in ("b1", "b2") and not cfg["enable_bias"]:
                continue
            state[n] = 0.1 * torch.randn(shapes[k])
    if starve:
        l, e = starve
        # Every input to layer l's block leans along +1 (its layer norm's bias), and expert e's row
        # points along -1: its logit is far below the others for every token.
        state[f"model.decoder.layers.{l}.final_layer_norm.bias"] = 2.0 + 0.1 * torch.randn(D)
        state[ferry_names(l)["gate"]][e] = -1.0
    os.makedirs(outdir, exist_ok=True)
    save_file(state, os.path.join(outdir, "model.safetensors"), metadata={"format": "pt"})
    conf = dict(cfg, model_type="opt", architectures=["OPTMoEForCausalLM"], torch_dtype="float32")
    with open(os.path.join(outdir, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    return state


def reference_model(torch, cfg, state):
    """transformers' OPT with the mixture blocks in place of the feed-forwards, loaded with state."""
    from transformers import OPTConfig, OPTForCausalLM
    model = OPTForCausalLM(OPTConfig(**{k: v for k, v in cfg.items() if k not in MOE}, attn_implementation="eager"))
    blocks = {}
    for l in moe_layers(cfg):
        layer = model.model.decoder.layers[l]
        blk = MoE.make(torch, cfg)
        # OPTDecoderLayer runs fc1, activation_fn, fc2 on the (tokens, D) rows: the block is fc1.
        layer.fc1, layer.activation_fn, layer.fc2 = blk, torch.nn.Identity(), torch.nn.Identity()
        blocks[l] = blk
    own = {}
    for n, p in model.named_parameters():
        own[n] = p
    with torch.no_grad():
        for n, t in state.items():
            if "block_sparse_moe" in n:
                continue
            own[n].copy_(t)
        for l, blk in blocks.items():
            for k, n in ferry_names(l).items():
                if getattr(blk, k) is not None:
                    getattr(blk, k).copy_(state[n])
    return model, blocks


def reference_state(model, blocks):
    # (a block's own parameters are named layers.l.fc1.gate etc. here: ferry's names below)
    out = {n: p.detach().clone() for n, p in model.named_parameters()
           if not any(f"layers.{l}.fc1." in n for l in blocks)}
    for l, blk in blocks.items():
        for k, n in ferry_names(l).items():
            if getattr(blk, k) is not None:
                out[n] = getattr(blk, k).detach().clone()
    return out


def torch_train(torch, cfg, state, toks, steps):
    """Each step's loss and aux term, the counts of every block, and the weights after `steps` steps:
    row j of batch k is window kB + j (tokens [wT, wT + T]), in order, as ferry's loader without
    shuffling; the model sees T tokens of a window and predicts the next T."""
    model, blocks = reference_model(torch, cfg, state)
    model.train()
    named = list(model.named_parameters())
    groups = [dict(params=[p for _, p in named if p.ndim >= 2], weight_decay=WEIGHT_DECAY),
              dict(params=[p for _, p in named if p.ndim < 2], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(BETA1, BETA2), eps=EPS)
    losses, auxes, counts = [], [], []
    for k in range(steps):
        win = [k * B + j for j in range(B)]
        ids = torch.tensor([toks[w * T:w * T + T + 1] for w in win], dtype=torch.long)
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids[:, :T], use_cache=False).logits
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        aux = cfg["router_aux_loss_coef"] * sum(blk.balance for blk in blocks.values())
        (ce + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(ce.item())
        auxes.append(aux.item())
        counts.append({l: blk.counts for l, blk in blocks.items()})
    return losses, auxes, counts, reference_state(model, blocks)


def ferry_train(ferry, src, data, save, log, steps):
    cmd = [ferry, "train", "--init", src, "--data", data, "--seq", str(T), "--batch", str(B), "--steps", str(steps),
           "--lr", repr(LR), "--min-lr", repr(LR), "--warmup", "0", "--weight-decay", repr(WEIGHT_DECAY),
           "--beta1", repr(BETA1), "--beta2", repr(BETA2), "--eps", repr(EPS), "--clip", repr(CLIP),
           "--no-shuffle", "--threads", "2", "--device", "cpu", "--quiet", "--log", log, "--save", save]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ferry train failed ({' '.join(cmd)}): " + (r.stderr or r.stdout).strip())
    lines = [json.loads(line) for line in open(log) if line.strip()]
    return [x["loss"] for x in lines], [x.get("aux_loss") for x in lines]


def load_saved(torch, d):
    from safetensors.torch import load_file
    return load_file(os.path.join(d, "model.safetensors"))


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def weights_error(saved, ref):
    err, worst = 0.0, None
    missing = sorted(set(ref) ^ set(saved))
    for n in set(ref) & set(saved):
        if n.endswith("self_attn.k_proj.bias"):  # zero analytic gradient: Adam moves it by rounding noise
            continue
        a, b = saved[n].double(), ref[n].double()
        e = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        if e > err:
            err, worst = e, n
    return err, worst, missing


def check_case(torch, ferry, tmp, name, spec, toks, data):
    changes, moe_changes, starve = spec
    cfg = {**BASE, **changes, **MOE, **moe_changes}
    src = os.path.join(tmp, name)
    state = build(torch, name, cfg, starve, src)
    problems = []
    for steps in (1, STEPS):
        save, log = os.path.join(tmp, f"{name}.{steps}.out"), os.path.join(tmp, f"{name}.{steps}.log")
        f_loss, f_aux = ferry_train(ferry, src, data, save, log, steps)
        r_loss, r_aux, counts, r_state = torch_train(torch, cfg, state, toks, steps)
        le = max(rel(a, b) for a, b in zip(f_loss, r_loss))
        ae = max(rel(a, b) for a, b in zip(f_aux, r_aux)) if all(a is not None for a in f_aux) else float("inf")
        we, worst, missing = weights_error(load_saved(torch, save), r_state)
        print(f"  {name} {steps} step(s): loss rel {le:.2e}, aux_loss rel {ae:.2e}, weights {we:.2e} ({worst})")
        if le > 1e-5:
            problems.append(f"{steps} steps: losses differ by {le:.2e} (ferry {f_loss}, torch {r_loss})")
        if ae > 1e-5:
            problems.append(f"{steps} steps: aux_loss differs by {ae:.2e} (ferry {f_aux}, torch {r_aux})")
        if we > 1e-4:
            problems.append(f"{steps} steps: weights differ by {we:.2e} ({worst})")
        if missing:
            problems.append(f"{steps} steps: tensors in one checkpoint only: {missing}")
        if starve and steps == STEPS:
            l, e = starve
            got = [c[l][e] for c in counts]
            if any(got):
                problems.append(f"the starved expert {e} of layer {l} got tokens: {got}")
            # Its weights: the initial ones decayed STEPS times (a zero gradient leaves AdamW's m at 0).
            n = ferry_names(l)["w1"]
            F = cfg["ffn_dim"]
            want = state[n][e * F:(e + 1) * F].double() * (1 - LR * WEIGHT_DECAY) ** STEPS
            saved = load_saved(torch, save)[n][e * F:(e + 1) * F].double()
            de = ((saved - want).norm() / want.norm()).item()
            print(f"  {name}: expert {e} of layer {l} got no token in {STEPS} steps; its fc1 is the decayed "
                  f"initial one within {de:.1e}")
            if de > 1e-6:
                problems.append(f"the starved expert's fc1 moved by more than the decay ({de:.2e})")
    return problems


def check_upcycle(torch, ferry, tmp, toks, data):
    """A mixture from a dense transformers checkpoint (see the docstring)."""
    from transformers import OPTConfig, OPTForCausalLM
    cfg = {**BASE, **MOE}
    dense_dir, moe_dir = os.path.join(tmp, "up_dense"), os.path.join(tmp, "up_moe")
    torch.manual_seed(99)
    dense = OPTForCausalLM(OPTConfig(**BASE))
    with torch.no_grad():
        for n, p in dense.named_parameters():
            one = 1.0 if "layer_norm" in n and n.endswith(".weight") else 0.0
            p.copy_(one + 0.1 * torch.randn(p.shape))
    dense.save_pretrained(dense_dir)
    os.makedirs(moe_dir, exist_ok=True)
    with open(os.path.join(moe_dir, "config.json"), "w") as f:
        json.dump(dict(cfg, model_type="opt", architectures=["OPTMoEForCausalLM"]), f)
    problems = []
    # lr 0: the saved weights are the upcycled start
    start = os.path.join(tmp, "up_start")
    cmd = [ferry, "train", "--init", dense_dir, "--model", moe_dir, "--data", data, "--seq", str(T), "--batch", str(B),
           "--steps", "1", "--lr", "0", "--min-lr", "0", "--warmup", "0", "--no-shuffle", "--threads", "2", "--quiet",
           "--log", start + ".log", "--save", start]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return [f"ferry train failed ({' '.join(cmd)}): {(r.stderr or r.stdout).strip()}"]
    first = json.loads(open(start + ".log").readline())["loss"]
    ids = torch.tensor([toks[w * T:w * T + T + 1] for w in range(B)], dtype=torch.long)
    with torch.no_grad():
        logits = dense(input_ids=ids[:, :T], use_cache=False).logits
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()
    print(f"  upcycle: first loss {first}, transformers' dense {want:.6f} (rel {rel(first, want):.1e})")
    if rel(first, want) > 1e-5:
        problems.append(f"the upcycled model's first loss {first} is not the dense model's {want}")
    saved = load_saved(torch, start)
    dsd = dense.state_dict()
    E, F, D = cfg["num_local_experts"], cfg["ffn_dim"], cfg["hidden_size"]
    for l in moe_layers(cfg):
        names = ferry_names(l)
        for k, dn, rows in (("w1", "fc1.weight", F), ("b1", "fc1.bias", F), ("w2", "fc2.weight", D), ("b2", "fc2.bias", D)):
            got = saved[names[k]]
            for e in range(E):
                if not torch.equal(got[e * rows:(e + 1) * rows], dsd[f"model.decoder.layers.{l}.{dn}"]):
                    problems.append(f"upcycled {names[k]}: expert {e} is not the dense {dn}")
        if float(saved[names["gate"]].std()) < 0.01:
            problems.append(f"upcycled {names['gate']} is not drawn")
    # 5 steps of the upcycled model against the reference from the same start
    state = dict(saved)
    save, log = os.path.join(tmp, "up.out"), os.path.join(tmp, "up.log")
    f_loss, f_aux = ferry_train(ferry, start, data, save, log, STEPS)
    r_loss, r_aux, _, r_state = torch_train(torch, cfg, state, toks, STEPS)
    le, ae = max(rel(a, b) for a, b in zip(f_loss, r_loss)), max(rel(a, b) for a, b in zip(f_aux, r_aux))
    we, worst, missing = weights_error(load_saved(torch, save), r_state)
    print(f"  upcycle {STEPS} steps: loss rel {le:.2e}, aux_loss rel {ae:.2e}, weights {we:.2e} ({worst})")
    if le > 1e-5 or ae > 1e-5 or we > 1e-4 or missing:
        problems.append(f"upcycled training: losses {le:.2e}, aux {ae:.2e}, weights {we:.2e} ({worst}), {missing}")
    return problems


def ferry_named_parameters(model, blocks):
    """(ferry's name, parameter) of the reference model, the mixture blocks' under ferry's names."""
    out = [(n, p) for n, p in model.named_parameters() if not any(f"layers.{l}.fc1." in n for l in blocks)]
    for l, blk in blocks.items():
        out += [(n, getattr(blk, k)) for k, n in ferry_names(l).items() if getattr(blk, k) is not None]
    return out


PAD_TAIL = 5  # the second sequence's last 5 tokens are padding


def check_padded(torch, ferry, tmp):
    """Padding goes to no expert (see the docstring): a fixture in test_reference's format, checked by
    build/test/test_reference against the reference with the blocks given the attention mask."""
    from safetensors.torch import save_file
    cfg = {**BASE, **MOE, "pad_token_id": 1}
    fixture = os.path.join(tmp, "padded")
    state = build(torch, "padded", cfg, None, fixture)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, VOCAB, (B, T), generator=g)  # (never the pad token: its embedding row is frozen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - PAD_TAIL:] = 0
    ids[1, T - PAD_TAIL:] = cfg["pad_token_id"]
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, 4] = labels[1, 3] = -100  # loss-masked real tokens: routed like any other
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    keep = mask.reshape(-1).bool()
    coef = cfg["router_aux_loss_coef"]

    def objective(model, blocks):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
        return logits, ce, ce + coef * sum(blk.balance for blk in blocks.values())

    model, blocks = reference_model(torch, cfg, state)
    for blk in blocks.values():
        blk.mask = keep
    model.train()
    logits, ce, total = objective(model, blocks)
    total.backward()
    problems = []
    for l, blk in blocks.items():  # every real token's K choices are counted, and nothing else
        if sum(blk.counts) != int(keep.sum()) * cfg["num_experts_per_tok"]:
            problems.append(f"the reference routed {sum(blk.counts)} choices in layer {l}")
    tensors = {"input_ids": ids.to(torch.int32), "attention_mask": mask.to(torch.int32),
               "targets": targets.to(torch.int32), "logits": logits.detach().contiguous(),
               "loss": ce.detach().reshape(1)}
    tensors.update({f"grad.{n}": p.grad.detach().clone() for n, p in ferry_named_parameters(model, blocks)})
    # 5 AdamW steps from the same weights (test_reference's hyperparameters: those of this script)
    model, blocks = reference_model(torch, cfg, state)
    for blk in blocks.values():
        blk.mask = keep
    model.train()
    named = ferry_named_parameters(model, blocks)
    groups = [dict(params=[p for _, p in named if p.ndim >= 2], weight_decay=WEIGHT_DECAY),
              dict(params=[p for _, p in named if p.ndim < 2], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(BETA1, BETA2), eps=EPS)
    step_loss, step_norm = [], []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        _, ce, total = objective(model, blocks)
        total.backward()
        step_norm.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in named], CLIP)))
        opt.step()
        step_loss.append(ce.item())
    tensors["step_loss"] = torch.tensor(step_loss, dtype=torch.float32)
    tensors["step_grad_norm"] = torch.tensor(step_norm, dtype=torch.float32)
    tensors.update({f"final.{n}": p.detach().clone() for n, p in named})
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(fixture, "expected.safetensors"))
    # test_reference: logits and loss within 1e-5, every gradient within 1e-4, the 5 steps' losses and
    # norms within 1e-4 and the weights after them within 1e-4 (its own tolerances)
    exe = os.path.join(os.path.dirname(ferry), "test", "test_reference")
    if not os.path.exists(exe):
        return problems + [f"no {exe} (build the tests)"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([exe, fixture], capture_output=True, text=True, env=dict(os.environ, FY_SOURCE_DIR=root))
    ours = r.stderr[r.stderr.find(f"fixture {fixture}"):] if f"fixture {fixture}" in r.stderr else r.stderr
    for line in ours.strip().splitlines()[1:]:
        print(f"  padded: {line.strip()}")
    if r.returncode != 0:
        problems.append(f"test_reference failed on the padded fixture:\n{ours.strip()[-1500:]}")
    return problems


def check_ranks(ferry, tmp, data):
    """2 data-parallel ranks against accumulation on one: the same bits (see the docstring)."""
    import shutil
    if not shutil.which("mpirun"):
        print("  ranks: skipped, mpirun is not installed")
        return None
    common = ["train", "--model", "opt-moe-tiny", "--data", data, "--seq", str(T), "--batch", "1", "--steps", "3",
              "--no-shuffle", "--threads", "1", "--device", "cpu", "--quiet"]
    runs = {"ranks": ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", ferry],
            "accum": [ferry]}
    out = {}
    for name, launch in runs.items():
        save, log = os.path.join(tmp, f"ranks_{name}"), os.path.join(tmp, f"ranks_{name}.log")
        extra = ["--grad-accum", "2"] if name == "accum" else []
        r = subprocess.run([*launch, *common, *extra, "--log", log, "--save", save], capture_output=True, text=True)
        if r.returncode != 0:
            return [f"ferry train ({name}) failed: {(r.stderr or r.stdout).strip()[-400:]}"]
        lines = [json.loads(x) for x in open(log) if x.strip()]
        out[name] = ([(x["loss"], x["aux_loss"], x["grad_norm"]) for x in lines],
                     open(os.path.join(save, "model.safetensors"), "rb").read())
    same_log, same_weights = out["ranks"][0] == out["accum"][0], out["ranks"][1] == out["accum"][1]
    print(f"  ranks: 2 ranks {out['ranks'][0]}, accumulation {out['accum'][0]}; weights the same bits: {same_weights}")
    return [] if same_log and same_weights else ["2 ranks and accumulation on one rank differ"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ferry")
    ap.add_argument("--only")
    ap.add_argument("--keep", help="keep the models and logs in this directory")
    a = ap.parse_args()
    import torch
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    ferry = os.path.abspath(a.ferry)
    tmp = a.keep or tempfile.mkdtemp(prefix="ferry_moe_")
    os.makedirs(tmp, exist_ok=True)
    data = os.path.join(tmp, "tokens.bin")
    toks = write_shard(data)
    failed = 0
    for name, spec in CASES.items():
        if a.only and name != a.only:
            continue
        try:
            problems = check_case(torch, ferry, tmp, name, spec, toks, data)
        except Exception as e:  # a crash is a failure of this case, with its message
            problems = [f"{type(e).__name__}: {e}"]
        print(f"{'ok  ' if not problems else 'FAIL'} {name}")
        for p in problems:
            print(f"       {p}")
        failed += bool(problems)
    if not a.only or a.only == "upcycle":
        try:
            problems = check_upcycle(torch, ferry, tmp, toks, data)
        except Exception as e:
            problems = [f"{type(e).__name__}: {e}"]
        print(f"{'ok  ' if not problems else 'FAIL'} upcycle")
        for p in problems:
            print(f"       {p}")
        failed += bool(problems)
    extra = 2
    if not a.only or a.only == "padded":
        try:
            problems = check_padded(torch, ferry, tmp)
        except Exception as e:
            problems = [f"{type(e).__name__}: {e}"]
        print(f"{'ok  ' if not problems else 'FAIL'} padded")
        for p in problems:
            print(f"       {p}")
        failed += bool(problems)
    if not a.only or a.only == "ranks":
        try:
            problems = check_ranks(ferry, tmp, data)
        except Exception as e:
            problems = [f"{type(e).__name__}: {e}"]
        if problems is not None:
            extra += 1
            print(f"{'ok  ' if not problems else 'FAIL'} ranks")
            for p in problems:
                print(f"       {p}")
            failed += bool(problems)
    total = (len(CASES) + extra) if not a.only else 1
    print(f"check_moe: {total - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
