#!/usr/bin/env python3
"""Rewrites a CUDA source file into host C++ for the CUDA emulator (README.md).

    rewrite.py IN.cu OUT.cc

Two constructs of CUDA C++ are not C++; everything else compiles with test/cudaemu/emu.h:
- a launch `kernel<<<grid, block[, smem[, stream]]>>>(args)` becomes
  `fy_emu_launch("kernel", kernel, grid, block, smem, stream, args)`;
- `extern __shared__ [__align__(n)] T name[];` becomes `T *name = (T *)fy_emu_dynamic_smem();`.
Line breaks are kept, so compiler messages and debuggers point at the .cu file's lines (#line).
"""
import re
import sys

OPEN = {"(": ")", "[": "]", "{": "}"}


def matching(s, i):
    """Index just past the bracket that closes s[i] (one of ( [ {)."""
    stack = [OPEN[s[i]]]
    j = i + 1
    while stack:
        c = s[j]
        if c in OPEN:
            stack.append(OPEN[c])
        elif c in ")]}":
            if c != stack.pop():
                raise SystemExit(f"rewrite.py: unbalanced {c!r} at offset {j}")
        elif c in "\"'":
            j = s.index(c, j + 1)  # no escaped quotes in launch arguments
        j += 1
    return j


def split_top(s):
    """s split at the commas outside brackets (launch configurations and argument lists)."""
    parts, depth, cur = [], 0, ""
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    parts.append(cur)
    return parts


def callee_start(s, end):
    """Where the kernel expression that ends at s[end] starts: a name, maybe qualified (::) and
    with template arguments (<...>)."""
    i = end
    while True:
        while i > 0 and s[i - 1] in " \t":
            i -= 1
        if i > 0 and s[i - 1] == ">":  # template arguments
            depth, i = 0, i - 1
            while True:
                if s[i] == ">":
                    depth += 1
                elif s[i] == "<":
                    depth -= 1
                    if depth == 0:
                        break
                i -= 1
        while i > 0 and (s[i - 1].isalnum() or s[i - 1] == "_"):
            i -= 1
        if s[i - 2:i] == "::":
            i -= 2
            continue
        return i


def rewrite_launches(s):
    out, pos = [], 0
    while True:
        k = s.find("<<<", pos)
        if k < 0:
            out.append(s[pos:])
            return "".join(out)
        c0 = callee_start(s, k)
        e = s.index(">>>", k)
        config = split_top(s[k + 3:e])
        if not 2 <= len(config) <= 4:
            raise SystemExit(f"rewrite.py: a launch with {len(config)} configuration values")
        config += ["0"] * (4 - len(config))
        p = e + 3
        while s[p] in " \t\n":
            p += 1
        if s[p] != "(":
            raise SystemExit("rewrite.py: no argument list after >>>")
        q = matching(s, p)
        args = s[p + 1:q - 1]
        callee = s[c0:k].strip()
        name = " ".join(callee.split())
        head = f'fy_emu_launch("{name}", {callee}, ' + ", ".join(x.strip() for x in config)
        out.append(s[pos:c0])
        out.append(head + ("," + args if args.strip() else "") + ")")
        # keep the line count: the configuration's line breaks go after the call
        out.append("\n" * (s[c0:p].count("\n") - head.count("\n")))
        pos = q


SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([A-Za-z_][\w\s]*?)\s+(\w+)\s*\[\s*\]\s*;")


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    src = open(sys.argv[1]).read()
    body = SHARED.sub(lambda m: f"{m.group(1)} *{m.group(2)} = ({m.group(1)} *)fy_emu_dynamic_smem();", src)
    body = rewrite_launches(body)
    with open(sys.argv[2], "w") as f:
        f.write('#include "test/cudaemu/emu.h"\n')
        f.write(f'#line 1 "{sys.argv[1]}"\n')
        f.write(body)


if __name__ == "__main__":
    main()
