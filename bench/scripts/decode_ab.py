"""Decode speed and tokens of two checkouts of this repository, alternated process by process.

Each round runs, for full depth (``exit_policy=none``) and the default mode, one process of the
old checkout, then one of the new, each importing its own ``eeserve`` (PYTHONPATH) and timing
greedy decode of smollm2 at batch 1, 8 and 32 (32-token bench prompts, 64 new tokens, 2 torch
threads). Writes every row, the per-round new/old ratios, their medians and whether the tokens
of the two checkouts are identical, with the provenance of the run.
Usage: decode_ab.py OLD_CHECKOUT NEW_CHECKOUT --rounds 3 --out FILE.json
(``decode_ab.py --measure MODE`` is the child each process runs.)
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from decode_rows import BATCHES, print_rows

from eeserve.config import EngineConfig

MODES = ("full", "default")


def measure(mode: str) -> None:
    options = {"exit_policy": "none"} if mode == "full" else {}
    print_rows(EngineConfig(model="smollm2", **options), {"mode": mode})


def run_side(checkout: Path, mode: str) -> list[dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", mode]
    out = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    flags = next(line for line in info if line.startswith("flags")).split()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} cores, {' '.join(isa)}"


def commit(checkout: Path) -> str:
    cmd = ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("old", nargs="?", type=Path)
    p.add_argument("new", nargs="?", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--measure", choices=MODES)
    args = p.parse_args()
    if args.measure:
        return measure(args.measure)
    rows = []
    for r in range(args.rounds):
        for mode in MODES:
            for side, checkout in (("old", args.old), ("new", args.new)):
                rows += [{"round": r, "side": side, **x} for x in run_side(checkout, mode)]
    summary = []
    for mode in MODES:
        for b in BATCHES:
            mine = [x for x in rows if x["mode"] == mode and x["batch"] == b]
            old = {x["round"]: x for x in mine if x["side"] == "old"}
            new = {x["round"]: x for x in mine if x["side"] == "new"}
            ratios = [new[r]["decode_tok_s"] / old[r]["decode_tok_s"] for r in old]
            same = all(new[r]["tokens_md5"] == old[r]["tokens_md5"] for r in old)
            summary.append(
                {
                    "mode": mode,
                    "batch": b,
                    "ratios_new_over_old": ratios,
                    "median_ratio": statistics.median(ratios),
                    "same_tokens": same,
                }
            )
            print(json.dumps(summary[-1]))
    provenance = {
        "commit": f"old {commit(args.old)}, new {commit(args.new)}",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": f"python bench/scripts/decode_ab.py OLD NEW --rounds {args.rounds}",
    }
    result = {"provenance": provenance, "summary": summary, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
