"""Decode speed of native GGUF weights against float32, alternated process by process.

Each round runs one process per weight source (``--weights float32``, then ``native``), each
timing greedy decode of the model at full depth (``--mode full``: ``exit_policy=none``) or in
the engine's default mode (``--mode default``: the model's shipped exit config as it comes;
float32 drafts with its int8 copy, native from the exits) at batch 1, 8 and 32 (32-token bench
prompts, 64 new tokens, 2 torch threads). Writes every row, the per-round
native/float32 ratios and their medians, whether the two sources' tokens are identical, and the
provenance of the run (command, commit, CPU model, ISA flags and the kernel path that ran).
Usage: native_weights.py --model smollm2 [--mode default] --rounds 3 --out FILE.json
(``native_weights.py --measure SOURCE --model M --mode MODE`` is the child each process runs.)
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from decode_rows import BATCHES, print_rows

from eeserve.config import EngineConfig

SOURCES = ("float32", "native")
MODES = ("full", "default")


def measure(source: str, model: str, mode: str) -> None:
    policy = {"exit_policy": "none"} if mode == "full" else {}
    print_rows(EngineConfig(model=model, weights=source, **policy), {"weights": source})


def run_side(source: str, model: str, mode: str) -> list[dict[str, object]]:
    script = str(Path(__file__).resolve())
    cmd = [sys.executable, script, "--measure", source, "--model", model, "--mode", mode]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def summarise(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    summary = []
    for b in BATCHES:
        mine = [x for x in rows if x["batch"] == b]
        f32 = {x["round"]: x for x in mine if x["weights"] == "float32"}
        nat = {x["round"]: x for x in mine if x["weights"] == "native"}
        ratios = [nat[r]["decode_tok_s"] / f32[r]["decode_tok_s"] for r in f32]  # type: ignore[operator]
        summary.append(
            {
                "batch": b,
                "float32_tok_s": [f32[r]["decode_tok_s"] for r in f32],
                "native_tok_s": [nat[r]["decode_tok_s"] for r in f32],
                "ratios_native_over_float32": ratios,
                "median_ratio": statistics.median(ratios),
                "same_tokens": all(nat[r]["tokens_md5"] == f32[r]["tokens_md5"] for r in f32),
            }
        )
        print(json.dumps(summary[-1]))
    return summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--mode", choices=MODES, default="full")
    p.add_argument("--measure", choices=SOURCES)
    args = p.parse_args()
    if args.measure:
        return measure(args.measure, args.model, args.mode)
    from eeserve.tuning.provenance import provenance

    rows = []
    for r in range(args.rounds):
        for source in SOURCES:
            rows += [{"round": r, **x} for x in run_side(source, args.model, args.mode)]
    record = provenance()
    record["command"] = " ".join(["python", "bench/scripts/native_weights.py", *sys.argv[1:]])
    result = {
        "provenance": record,
        "setup": f"{'full depth' if args.mode == 'full' else 'default mode'}, 32-token prompts, "
        "64 new tokens, 2 torch threads, greedy",
        "summary": summarise(rows),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
