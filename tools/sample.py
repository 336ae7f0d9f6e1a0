#!/usr/bin/env python3
"""Continue a text prompt with a ferry model through a Hugging Face tokenizer.

`ferry sample` works on token ids (or bytes, for the demo model's byte vocabulary): this encodes
the prompt with the tokenizer, runs `ferry sample --prompt-ids`, and prints the decoded text.
--tokens, --temperature, --top-k, --top-p, --stop, --seq, --seed, --threads, --model, --device and
--precision go to ferry sample; the stop token (by default the model's end of sequence) is not
printed.

Example:
  python3 tools/sample.py --tokenizer facebook/opt-125m --init out/ft --tokens 50 "The capital of France is"
"""

import os
import sys

# tools/tokenize.py shares its name with the standard library's `tokenize`, which transformers
# imports: the script's own directory leaves the path so that it gets the real one.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402
import subprocess  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(prog="sample.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, metavar="NAME_OR_DIR",
                    help="a Hugging Face tokenizer name or directory")
    ap.add_argument("--init", required=True, metavar="DIR", help="the model directory (ferry train --save)")
    ap.add_argument("--ferry", default=os.path.join(_here, "..", "build", "ferry"), metavar="PATH",
                    help="the ferry program (default: build/ferry of this checkout)")
    passed = ("--tokens", "--temperature", "--top-k", "--top-p", "--stop", "--seq", "--seed", "--threads", "--model",
              "--device", "--precision")
    for flag in passed:
        ap.add_argument(flag, metavar="X", help="as ferry sample's")
    ap.add_argument("prompt", help="the text to continue")
    args = ap.parse_args(argv)
    rest = [x for flag in passed if getattr(args, flag[2:].replace("-", "_")) is not None
            for x in (flag, getattr(args, flag[2:].replace("-", "_")))]
    try:
        from transformers import AutoTokenizer
    except ImportError:
        sys.exit("sample.py: needs the 'transformers' package (pip install transformers)")
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    # As the tokenizer encodes by default: OPT's puts </s> first, where its documents begin (and
    # tools/tokenize.py's separator puts it before every document but the first).
    ids = tok(args.prompt)["input_ids"]
    if not ids:
        sys.exit("sample.py: the prompt has no tokens")
    cmd = [args.ferry, "sample", "--init", args.init, "--prompt-ids", ",".join(map(str, ids)), *rest]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        return r.returncode
    out = [int(x) for x in r.stdout.strip().split(",") if x]
    print(tok.decode(out, skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
