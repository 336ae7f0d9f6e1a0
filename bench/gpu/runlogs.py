"""What bench/gpu/check.sh's offloading steps read back from ferry's output: a run's rates from its
--log, the compute stream's waits and a plan's prediction from their printed lines, and how the
speculative updates went and how many chunks the device updated."""
import json
import re
import statistics


def rate(d, name, rounds=(1, 2)):
    """Median tokens/s and GFLOP/s of the timed steps (each run's first left out) of d/NAME-R.jsonl."""
    rows = [json.loads(l) for r in rounds for l in list(open(f"{d}/{name}-{r}.jsonl"))[1:]]
    return statistics.median(x["tokens_per_s"] for x in rows), statistics.median(x["gflops"] for x in rows)


def waits(path):
    """The 'compute waited per step' line of a run (--profile-waits) or a plan, or None."""
    m = re.search(r"compute waited per step(?: over \d+ steps)?: (.*)", open(path).read())
    return m.group(1).strip() if m else None


def predicted(path):
    """The tokens/s a printed plan predicts, or None (no plan: it did not fit)."""
    m = re.search(r"predicted: ([0-9.]+) s/step, ([0-9]+) tokens/s", open(path).read())
    return float(m.group(2)) if m else None


def spec(path):
    """A run's speculative updates (its summary line): chunks, steps kept and steps that speculated."""
    m = re.search(r"speculative updates of (\d+) chunks: kept in (\d+) of (\d+)", open(path).read())
    return {"chunks": int(m.group(1)), "kept": int(m.group(2)), "speculated": int(m.group(3))} if m else None


def clipping(path):
    """The tokens/s a printed plan with speculative updates predicts while the norm clips, or None."""
    m = re.search(r"while the norm clips .*?: ([0-9.]+) s/step, ([0-9]+) tokens/s", open(path).read())
    return float(m.group(2)) if m else None


def device_updates(d, name, rounds=(1, 2)):
    """The host chunks the device updated (--device-updates, from the plan) in d/NAME-R.jsonl's last
    line, 0 where none."""
    last = json.loads(list(open(f"{d}/{name}-{rounds[-1]}.jsonl"))[-1])
    return last.get("device_updates", 0)
