#!/usr/bin/env python3
"""Hugging Face reference fixtures for ferry's OPT implementation.

Default mode: build two small random OPT models with transformers (float32, eager attention, no
dropout), save them as Hugging Face checkpoints, and record on one fixed padded batch the logits,
the loss, every parameter gradient and the result of 5 AdamW steps with gradient clipping. Output
goes to test/reference/<name>/{config.json, model.safetensors, expected.safetensors}.

    python3 test/reference/make_reference.py            # regenerate both fixtures
    python3 test/reference/make_reference.py --only pre_ln

Check mode: prove that a checkpoint ferry wrote loads in transformers and gives ferry's logits.

    python3 test/reference/make_reference.py --check-export DIR --dump FILE

FILE is a safetensors file with "input_ids" int32 (B,T), optional "attention_mask" (B,T), and
"logits" (B,T,V) computed by ferry. Exit status 0 when the normalised L2 error
||ferry - hf|| / ||hf|| is below --tol (1e-5), 1 otherwise, 2 on a load problem.

Needs: pip install torch transformers safetensors
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

B, T = 3, 9
STEPS = 5
LR, BETA1, BETA2, EPS, WEIGHT_DECAY, CLIP = 1e-2, 0.9, 0.95, 1e-8, 0.1, 1.0

# Two shapes covering both OPT layer orders. post_ln also has word_embed_proj_dim != hidden_size,
# so project_in / project_out exist (as in facebook/opt-350m), and no final layer norm.
MODELS = {
    "pre_ln": dict(
        seed=1234,
        config=dict(
            vocab_size=61, hidden_size=24, num_attention_heads=3, ffn_dim=40, num_hidden_layers=2,
            max_position_embeddings=32, word_embed_proj_dim=24, do_layer_norm_before=True,
        ),
    ),
    "post_ln": dict(
        seed=5678,
        config=dict(
            vocab_size=53, hidden_size=24, num_attention_heads=3, ffn_dim=36, num_hidden_layers=2,
            max_position_embeddings=32, word_embed_proj_dim=16, do_layer_norm_before=False,
        ),
    ),
}

# Right padding only: number of padded tokens at the end of each row.
PAD_TAIL = [0, 2, 4]


def _imports():
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    return torch, transformers, load_file, save_file


def build_model(name, spec):
    torch, transformers, _, _ = _imports()
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(spec["seed"])
    cfg = OPTConfig(
        **spec["config"],
        dropout=0.0, attention_dropout=0.0, layerdrop=0.0, activation_function="relu",
        enable_bias=True, layer_norm_elementwise_affine=True, tie_word_embeddings=True,
        use_cache=False, attn_implementation="eager",
    )
    assert cfg._attn_implementation == "eager"
    model = OPTForCausalLM(cfg).float()
    # Overwrite every parameter with non-trivial values: zero biases and unit layer norms would hide
    # bugs (a bias gradient never applied, a layer norm weight read from the wrong place).
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, dtype=torch.float32) * 0.1
            if "layer_norm" in pname and pname.endswith(".weight"):
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise)
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight, "lm_head must stay tied"
    return model


def make_batch(torch, vocab, pad_token_id, seed):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (B, T), generator=g)
    # Keep the pad token out of the real tokens: nn.Embedding(padding_idx=pad_token_id) in HF OPT
    # drops the lookup gradient of that row, a quirk the fixture should not depend on.
    while (input_ids == pad_token_id).any():
        redraw = torch.randint(0, vocab, (B, T), generator=g)
        input_ids = torch.where(input_ids == pad_token_id, redraw, input_ids)
    attention_mask = torch.ones(B, T, dtype=torch.long)
    for b, n in enumerate(PAD_TAIL):
        if n:
            attention_mask[b, T - n:] = 0
            input_ids[b, T - n:] = pad_token_id  # what a tokenizer puts there
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    # Two more ignored labels at random real positions (not position 0, whose label is never used).
    real = [(b, t) for b in range(B) for t in range(1, T) if attention_mask[b, t] == 1]
    for i in torch.randperm(len(real), generator=g)[:2].tolist():
        labels[real[i]] = -100
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    return input_ids, attention_mask, labels, targets


def load_saved(path):
    torch, transformers, _, _ = _imports()
    from transformers import OPTForCausalLM
    model, info = OPTForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    return model, info


def param_groups(model):
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.ndim < 2]
    return [dict(params=decay, weight_decay=WEIGHT_DECAY), dict(params=no_decay, weight_decay=0.0)]


def generate(name, spec, outdir):
    torch, transformers, load_file, save_file = _imports()
    os.makedirs(outdir, exist_ok=True)
    model = build_model(name, spec)
    cfg = model.config

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for f in ("config.json", "model.safetensors"):
            shutil.copyfile(os.path.join(tmp, f), os.path.join(outdir, f))
    for stale in ("generation_config.json",):
        if os.path.exists(os.path.join(outdir, stale)):
            os.remove(os.path.join(outdir, stale))

    input_ids, attention_mask, labels, targets = make_batch(
        torch, cfg.vocab_size, cfg.pad_token_id, spec["seed"] + 1)

    # The fixture is defined by the saved checkpoint: reload it and check that nothing moved.
    model, info = load_saved(outdir)
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} if isinstance(info, dict) else {}
    assert not bad, f"{name}: loading the saved checkpoint reported {bad}"
    ckpt = load_file(os.path.join(outdir, "model.safetensors"))
    params = dict(model.named_parameters())
    for k, v in ckpt.items():
        assert v.dtype == torch.float32, f"{k} is {v.dtype}"
        assert torch.equal(params[k].detach(), v), f"{k} changed on reload"
    assert set(ckpt) == set(params), f"checkpoint keys {sorted(set(ckpt) ^ set(params))}"
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight

    # One forward/backward.
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
    out.loss.backward()
    logits, loss = out.logits.detach(), out.loss.detach()
    # HF's loss must be the plain mean over non-ignored shifted targets.
    ref = torch.nn.functional.cross_entropy(
        logits.reshape(-1, cfg.vocab_size), targets.reshape(-1), ignore_index=-100, reduction="mean")
    assert torch.allclose(ref, loss, rtol=1e-6, atol=0), (ref.item(), loss.item())
    grads = {f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()}

    # 5 AdamW steps, starting again from the saved weights.
    model, _ = load_saved(outdir)
    model.train()
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=(BETA1, BETA2), eps=EPS)
    step_loss, step_norm = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        o = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
        o.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        step_loss.append(o.loss.item())
        step_norm.append(float(norm))
    assert abs(step_loss[0] - loss.item()) <= 1e-6 * abs(loss.item())

    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "attention_mask": attention_mask.to(torch.int32),
        "labels": labels.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.float().contiguous(),
        "loss": loss.float().reshape(1),
        "step_loss": torch.tensor(step_loss, dtype=torch.float32),
        "step_grad_norm": torch.tensor(step_norm, dtype=torch.float32),
    }
    tensors.update(grads)
    tensors.update({f"final.{n}": p.detach().clone() for n, p in model.named_parameters()})
    meta = {
        "model": name, "lr": repr(LR), "beta1": repr(BETA1), "beta2": repr(BETA2), "eps": repr(EPS),
        "weight_decay": repr(WEIGHT_DECAY), "weight_decay_rule": "ndim>=2", "clip": repr(CLIP),
        "steps": str(STEPS), "batch": str(B), "seq": str(T),
        "pad_token_id": str(cfg.pad_token_id), "loss_reduction": "mean over targets != -100",
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(outdir, "expected.safetensors"), metadata=meta)
    _sort_metadata(os.path.join(outdir, "expected.safetensors"))
    for f in os.listdir(outdir):
        os.chmod(os.path.join(outdir, f), 0o644)

    nparam = sum(p.numel() for p in model.parameters())
    size = sum(os.path.getsize(os.path.join(outdir, f)) for f in os.listdir(outdir))
    print(f"{name}: {nparam} params ({len(grads)} tensors), loss {loss.item():.6f}, "
          f"step_loss {' '.join(f'{x:.4f}' for x in step_loss)}, "
          f"grad_norm {' '.join(f'{x:.4f}' for x in step_norm)}, {size/1024:.0f} KiB in {outdir}")
    assert size < 1 << 20


def _sort_metadata(path):
    """safetensors writes __metadata__ in hash-map order; sort it so reruns give identical bytes."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":")).encode()
        assert len(text) <= n
        f.seek(8)
        f.write(text + b" " * (n - len(text)))


def check_export(ckpt_dir, dump, tol, valid_only):
    torch, transformers, load_file, _ = _imports()
    try:
        model, info = load_saved(ckpt_dir)
    except Exception as e:  # noqa: BLE001 - any load failure is the answer
        print(f"check-export: transformers could not load {ckpt_dir}: {e}")
        return 2
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
    if info.get("error_msgs"):
        problems["error_msgs"] = info["error_msgs"]
    if problems:
        # A missing key would be silently random-initialised by transformers: that is a failure.
        print(f"check-export: loading {ckpt_dir} reported {problems}")
        return 2
    d = load_file(dump)
    ids = d["input_ids"].long()
    mask = d["attention_mask"].long() if "attention_mask" in d else None
    theirs = d["logits"].float()
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    if ours.shape != theirs.shape:
        print(f"check-export: shape {tuple(theirs.shape)} in dump, transformers gives {tuple(ours.shape)}")
        return 1
    if valid_only and mask is not None:
        keep = mask.bool()
        ours, theirs = ours[keep], theirs[keep]
    diff = theirs - ours
    max_abs = diff.abs().max().item()
    rel = (diff.norm() / ours.norm().clamp_min(1e-30)).item()
    ok = rel < tol
    print(json.dumps({"check": "export", "dir": ckpt_dir, "shape": list(d["logits"].shape),
                      "max_abs": max_abs, "rel_l2": rel, "tol": tol, "ok": ok}))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=HERE, help="folder that receives <name>/ (default: this script's folder)")
    ap.add_argument("--only", choices=sorted(MODELS), action="append", help="generate only this fixture")
    ap.add_argument("--check-export", metavar="DIR", help="HF checkpoint folder written by ferry")
    ap.add_argument("--dump", metavar="FILE", help="safetensors with input_ids, [attention_mask], logits")
    ap.add_argument("--tol", type=float, default=1e-5, help="normalised L2 error bound (default 1e-5)")
    ap.add_argument("--valid-only", action="store_true",
                    help="compare logits only where attention_mask == 1")
    args = ap.parse_args()

    torch, transformers, _, _ = _imports()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)  # one summation order, so reruns give the same bits
    torch.use_deterministic_algorithms(True)

    if args.check_export or args.dump:
        if not (args.check_export and args.dump):
            ap.error("--check-export and --dump go together")
        return check_export(args.check_export, args.dump, args.tol, args.valid_only)

    for name in args.only or sorted(MODELS, key=list(MODELS).index):
        generate(name, MODELS[name], os.path.join(args.out, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
