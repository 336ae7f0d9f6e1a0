#!/usr/bin/env python3
"""PyTorch peer benchmark: train an OPT shape (default opt-125m) with transformers + torch.optim.AdamW.

Random init (nothing is downloaded), float32 (or --dtype bf16: autocast to bfloat16 over fp32
weights, the fused AdamW on CUDA: mixed precision as ferry's bf16, fp32 master weights and state),
dropout and attention dropout 0 (ferry has no dropout), random token batches, the same batch and
sequence as ferry's benchmark, and the same step as `ferry train`'s defaults: gradients clipped to
global norm 1, AdamW with betas (0.9, 0.95). The first --warmup steps are not timed. Prints one JSON
line:

  {"peer":"torch","model":"opt-125m","batch":4,"seq":128,"threads":2,"step_s_median":...,
   "tokens_per_s":...,"gflops":...,"peak_rss_mib":...}

Needs: pip install torch transformers
"""

import argparse
import json
import resource
import statistics
import sys
import time


def flops_per_step(n_params, n_layers, hidden, batch, seq):
    """Model FLOPs of one training step, counted as llm.c, nanoGPT and PaLM (appendix B) count them.

    Dense part: every parameter does one multiply-add per token in forward (2 FLOPs) and two in
    backward (grad of input and grad of weight, 4 FLOPs): 6 * N * tokens. N counts the tied
    embedding once (that count is exactly the lm_head matmul; the lookup is free) and includes the
    positional embeddings, as llm.c does.
    Attention part (not in N): per layer and sequence, forward Q K^T is T*T*D multiply-adds and
    A V another T*T*D: 4*T^2*D FLOPs; backward is twice forward: 12*T^2*D in all. The causal mask
    is not discounted (the published MFU figures do not discount it either):
        FLOPs/step = 6 * N * B * T + 12 * L * B * T^2 * D
    (Megatron's 96*B*s*l*h^2*(1 + s/(6h) + ...) has 16 instead of 12 because it counts a recomputed
    forward.)
    """
    tokens = batch * seq
    return 6 * n_params * tokens + 12 * n_layers * batch * seq * seq * hidden


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
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error("--steps must be larger than --warmup")

    import torch
    import transformers
    from transformers import OPTConfig, OPTForCausalLM

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)

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
    fused = {"fused": True} if dev.type == "cuda" else {}
    # ferry's AdamW defaults (runtime/optimizer.c): betas (0.9, 0.95), eps 1e-8.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=args.weight_decay, **fused)
    amp = lambda: torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    n_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(dev)
               for _ in range(args.steps)]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times, losses = [], []
    for i, ids in enumerate(batches):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with amp():
            loss = model(input_ids=ids, labels=ids).loss
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
    flops = flops_per_step(n_params, cfg.num_hidden_layers, cfg.hidden_size, args.batch, args.seq)
    out = {
        "peer": "torch", "model": args.model, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
        "threads": args.threads, "step_s_median": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1), "gflops": round(flops / step_s / 1e9, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "attn": args.attn, "device": dev.type, "params": n_params, "flops_per_step": flops,
        "steps_timed": len(times), "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    if dev.type == "cuda":
        out["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
