#!/usr/bin/env python3
"""PyTorch peer benchmark for `ferry sample`: transformers' generate on the same model and prompt.

Loads a Hugging Face model directory (ferry train --save writes one), runs greedy generate with
its key/value cache on --prompt-ids (the same ids ferry sample gets), fp32 on the CPU, and times
the prompt's pass (generate of one token) apart from the tokens after it (generate of --tokens,
less the first). Prints one JSON line:

  {"peer":"torch_sample","threads":2,"prompt_tokens":400,"tokens":40,"prompt_tokens_per_s":...,
   "tokens_per_s":...,"ids":[...]}

(`ids` are the tokens generated, to compare with ferry's.) Needs: pip install torch transformers
"""

import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", required=True, metavar="DIR", help="the model directory")
    ap.add_argument("--prompt-ids", required=True, metavar="IDS", help="comma-separated token ids")
    ap.add_argument("--tokens", type=int, default=40, help="tokens to generate (default 40)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    args = ap.parse_args()
    try:
        import torch
        from transformers import OPTForCausalLM
    except ImportError:
        sys.exit("torch_sample.py: needs torch and transformers (pip install torch transformers)")
    torch.set_num_threads(args.threads)
    ids = [int(x) for x in args.prompt_ids.split(",")]
    if args.tokens < 2:
        sys.exit("torch_sample.py: --tokens must be at least 2 (the first one is timed with the prompt)")
    model = OPTForCausalLM.from_pretrained(args.init, torch_dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    kw = dict(do_sample=False, use_cache=True, pad_token_id=model.config.pad_token_id,
              eos_token_id=None)  # (as ferry sample --stop none: exactly --tokens)
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **kw)
        t2 = time.perf_counter()
    first = t1 - t0
    rest = (t2 - t1) - first  # the same prompt's pass, then the tokens after the first
    print(json.dumps({"peer": "torch_sample", "threads": args.threads, "prompt_tokens": len(ids),
                      "tokens": args.tokens, "prompt_tokens_per_s": round(len(ids) / first, 1),
                      "tokens_per_s": round((args.tokens - 1) / rest, 2),
                      "ids": out[0, len(ids):].tolist()}))


if __name__ == "__main__":
    main()
