#!/usr/bin/env python3
"""PyTorch peer benchmark: train an OPT shape (default opt-125m) with transformers + torch.optim.AdamW.

Random init (nothing is downloaded), float32 (or --dtype bf16: autocast to bfloat16 over fp32
weights: mixed precision as ferry's bf16, fp32 master weights and state), dropout and attention
dropout 0 (ferry trains without dropout by default), the same batch and sequence as ferry's
benchmark, and the same step as `ferry train`'s defaults: gradients clipped to global norm 1,
AdamW with betas (0.9, 0.95), eps 1e-8, the fused implementation on CPU and GPU alike (a printed
note and the default one where this torch has no fused AdamW for the device), weight decay on
exactly the parameters ferry decays (every parameter of two dimensions: the matrices and the
embedding tables; not the biases nor the layer norms' weights: core/opt.c marks them so).

Tokens: with --data SHARD, the windows ferry takes from that shard in order (ferry train
--no-shuffle, bench/cpu_train --data): step k's row j is window (k*B + j) mod Nw, tokens
[w*T, w*T+T] of Nw = (count-1) // T windows, inputs its first T and targets its last T, so both
sides train on the same tokens at the same positions; without it, random tokens. The loss is the
mean cross-entropy of the T targets (ferry's; transformers' labels= would drop one position).

The first --warmup steps are not timed. Prints one JSON line, and on a GPU (--compile auto) a
second with the model under torch.compile:

  {"peer":"torch","model":"opt-125m","batch":4,"seq":128,"threads":2,"step_s_median":...,
   "tokens_per_s":...,"gflops":...,"gflops_llmc":...,"compile":false,"adamw":"fused",...}

Needs: pip install torch transformers
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np


def flops_per_step(model, n_layers, hidden, batch, seq, count="palm"):
    """Model FLOPs of one training step: the same count as ferry's fy_opt_step_flops (core/opt.c).

    Every weight used in a product does a multiply-add per token forward (2 FLOPs) and two backward
    (4 FLOPs): 6 FLOPs per parameter and token; attention's QK^T and AV are 12 x L x D x T a token
    over forward and backward (the whole T x T square).
    count "palm" (ferry's, PaLM's appendix B and Megatron-LM's): the non-embedding parameters
    (biases and layer norms included, as PaLM's N), the lm_head's product once whether tied or not;
    the input and positional tables are lookups and do not count.
    count "llmc" (llm.c's gpt2_estimate_mfu): every parameter (the tied table once, an untied
    lm_head besides the input table), and attention's causal half, 6 x L x D x T a token.
    """
    tokens = batch * seq
    n_all = sum(p.numel() for p in model.parameters())  # a tied table once
    if count == "llmc":
        return 6 * n_all * tokens + 6 * n_layers * hidden * seq * tokens
    dec = model.model.decoder
    positions = dec.embed_positions.weight.numel()
    tied = model.lm_head.weight is dec.embed_tokens.weight
    # n_all - positions holds the token table once (the lm_head's product when tied); untied, the
    # lm_head's matrix is there besides, and the input table is the lookup that goes.
    dense = n_all - positions - (0 if tied else dec.embed_tokens.weight.numel())
    return 6 * dense * tokens + 12 * n_layers * hidden * seq * tokens


def read_shard(path):
    """The tokens of one shard in llm.c's format (runtime/data.h): 256 int32, then the tokens."""
    header = np.fromfile(path, dtype=np.int32, count=256)
    if header[0] == 20240520 and header[1] == 1:
        dtype = np.uint16
    elif header[0] == 20240801 and header[1] == 7:
        dtype = np.uint32
    else:
        sys.exit(f"torch_opt.py: {path} is not a token shard (magic {header[0]}, version {header[1]})")
    tokens = np.fromfile(path, dtype=dtype, offset=256 * 4)
    if len(tokens) != header[2]:
        sys.exit(f"torch_opt.py: {path} holds {len(tokens)} tokens, its header says {header[2]}")
    return tokens.astype(np.int64)


def shard_batches(tokens, steps, batch, seq):
    """ferry's in-order windows (runtime/data.c, one shard, one rank): inputs and targets per step."""
    nw = (len(tokens) - 1) // seq
    if nw < batch:
        sys.exit(f"torch_opt.py: the shard has {nw} windows of {seq + 1} tokens, a batch needs {batch}")
    out = []
    for k in range(steps):
        rows = [tokens[w * seq:w * seq + seq + 1] for w in ((k * batch + j) % nw for j in range(batch))]
        out.append(np.stack(rows))
    return out


# The public facebook/opt-* shapes: hidden, layers, heads, ffn.
SHAPES = {"opt-125m": (768, 12, 12, 3072), "opt-350m": (1024, 24, 16, 4096), "opt-1.3b": (2048, 24, 32, 8192),
          "opt-2.7b": (2560, 32, 32, 10240), "opt-6.7b": (4096, 32, 32, 16384)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="total training steps (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps not timed (default 2)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                    help="transformers attention implementation (default sdpa)")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="clip gradients to this global norm before each step, as ferry train does by "
                         "default (default 1.0; 0: no clipping)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu; cuda also works)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="opt-125m", choices=sorted(SHAPES), help="OPT shape (default opt-125m)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype (default fp32)")
    ap.add_argument("--data", help="a token shard: train on ferry's in-order windows of it (default: random tokens)")
    ap.add_argument("--compile", choices=["auto", "no", "also", "only"], default="auto",
                    help="a second run and JSON line with the model under torch.compile: auto (on a GPU), "
                         "no, also (on any device); only: that run alone")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error("--steps must be larger than --warmup")

    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)

    if args.data:
        tokens = read_shard(args.data)
        windows = shard_batches(tokens, args.steps, args.batch, args.seq)
        source = os.path.abspath(args.data)
    else:
        g = np.random.default_rng(args.seed + 1)
        windows = [g.integers(0, 50272, (args.batch, args.seq + 1)) for _ in range(args.steps)]
        source = "random"
    batches = [torch.from_numpy(w).to(dev) for w in windows]

    runs = [False]
    if args.compile == "also" or (args.compile == "auto" and dev.type == "cuda"):
        runs.append(True)
    elif args.compile == "only":
        runs = [True]
    for compiled in runs:
        print(json.dumps(train(args, torch, transformers, dev, batches, source, compiled)), flush=True)
    return 0


def train(args, torch, transformers, dev, batches, source, compiled):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(args.seed)
    # OPTConfig's defaults are facebook/opt-125m: vocab 50272, hidden 768, 12 layers, 12 heads,
    # ffn 3072, 2048 positions, pre-LN, ReLU, tied lm_head.
    h, layers, heads, ffn = SHAPES[args.model]
    extra = {} if args.model != "opt-350m" else {"word_embed_proj_dim": 512, "do_layer_norm_before": False}
    cfg = OPTConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=ffn,
                    word_embed_proj_dim=extra.get("word_embed_proj_dim", h),
                    do_layer_norm_before=extra.get("do_layer_norm_before", True),
                    dropout=0.0, attention_dropout=0.0, layerdrop=0.0, use_cache=False,
                    attn_implementation=args.attn)
    model = OPTForCausalLM(cfg).to(device=dev, dtype=torch.float32)
    model.train()
    if int(batches[0].max()) >= cfg.vocab_size:
        sys.exit(f"torch_opt.py: a token is past the vocabulary of {cfg.vocab_size}")
    # ferry's rule (core/opt.c: a parameter decays when it has two dimensions): matrices and the
    # embedding tables decay, biases and layer norms' weights do not. (parameters() gives a tied
    # table once.)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # ferry's AdamW defaults (runtime/optimizer.c): betas (0.9, 0.95), eps 1e-8. Fused on any
    # device this torch has the kernel for (CPU too since torch 2.4).
    hyper = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    try:
        opt = torch.optim.AdamW(groups, fused=True, **hyper)
        adamw = "fused"
    except (RuntimeError, TypeError, ValueError) as e:
        print(f"torch_opt.py: no fused AdamW on {dev.type} in torch {torch.__version__} ({e}); "
              "the default implementation instead", file=sys.stderr)
        opt = torch.optim.AdamW(groups, **hyper)
        adamw = "default"
    amp = lambda: torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    run = torch.compile(model) if compiled else model

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i, window in enumerate(batches):
        x, y = window[:, :-1], window[:, 1:]
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with amp():
            logits = run(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        losses.append(loss.item())
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)

    step_s = statistics.median(times)
    tokens = args.batch * args.seq
    flops = flops_per_step(model, cfg.num_hidden_layers, cfg.hidden_size, args.batch, args.seq)
    flops_llmc = flops_per_step(model, cfg.num_hidden_layers, cfg.hidden_size, args.batch, args.seq, "llmc")
    out = {
        "peer": "torch", "model": args.model, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
        "threads": args.threads, "step_s_median": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1), "gflops": round(flops / step_s / 1e9, 2),
        "gflops_llmc": round(flops_llmc / step_s / 1e9, 2), "flops_count": "palm",
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "attn": args.attn, "device": dev.type, "compile": compiled, "adamw": adamw, "data": source,
        "params": sum(p.numel() for p in params), "flops_per_step": flops, "flops_per_step_llmc": flops_llmc,
        "steps_timed": len(times), "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    if dev.type == "cuda":
        out["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


if __name__ == "__main__":
    sys.exit(main())
