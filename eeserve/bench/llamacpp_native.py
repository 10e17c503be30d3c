"""One run of llama.cpp's own ``llama-batched-bench``, and the parsing of what it prints.

Contract: ``batched_bench_command(tool, gguf, threads, prompt_len, new_tokens, batches)`` is the
command line: ``batches`` sequences of ``prompt_len`` random tokens prefilled together, then
``new_tokens`` decode steps of one token per sequence, all with ``threads`` threads and
llama.cpp's own defaults otherwise (flash attention ``auto``, ``-ub 512``), output as JSON lines.
``parse_batched_bench(text)`` turns that output (JSON lines, or the Markdown table it prints
without ``--output-format jsonl``) into ``BatchedBenchRow``s; ``run_batched_bench`` runs the tool
once per call (again when it exits cleanly without every row: ``RUNS_FOR_ROWS``) and returns its
rows by batch size, raising ``RuntimeError`` with the tool's stderr when it fails.

What is timed matches ``bench.measure.run_engine``'s decode rate: the engine generating
``max_tokens`` tokens makes ``max_tokens - 1`` decode steps after prefill, so llama.cpp is run
with ``new_tokens = max_tokens - 1`` at the same positions; its ``S_TG`` (batch × new_tokens /
decode seconds) is then the same quantity as the engine's ``decode_tokens_per_s``.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

# On a loaded machine llama-batched-bench sometimes exits 0 with a batch size's row missing from
# its output (about one run in three beside two busy loops, on a tiny model): such a run is
# repeated, up to this many runs in all. A crash is reported at once.
RUNS_FOR_ROWS = 3


@dataclass(frozen=True)
class BatchedBenchRow:
    prompt_len: int  # PP
    new_tokens: int  # TG
    batch: int  # B (parallel sequences)
    prefill_s: float  # T_PP
    decode_s: float  # T_TG
    decode_tok_s: float  # S_TG = batch * new_tokens / decode_s


def batched_bench_command(
    tool: Path, gguf: Path, threads: int, prompt_len: int, new_tokens: int, batches: list[int]
) -> list[str]:
    ctx = max(batches) * (prompt_len + new_tokens)  # every sequence's own KV: no skipped cell
    return [
        str(tool),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(ctx),
        "-b",
        str(max(2048, max(batches) * prompt_len)),
        "-npp",
        str(prompt_len),
        "-ntg",
        str(new_tokens),
        "-npl",
        ",".join(str(b) for b in batches),
        "--output-format",
        "jsonl",
    ]


def _from_json(line: str) -> BatchedBenchRow:
    d = json.loads(line)
    return BatchedBenchRow(
        int(d["pp"]),
        int(d["tg"]),
        int(d["pl"]),
        float(d["t_pp"]),
        float(d["t_tg"]),
        float(d["speed_tg"]),
    )


def _from_table(line: str) -> BatchedBenchRow | None:
    # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |  T s | S t/s |
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 10 or not cells[0].isdigit():
        return None
    pp, tg, b = int(cells[0]), int(cells[1]), int(cells[2])
    return BatchedBenchRow(pp, tg, b, float(cells[4]), float(cells[6]), float(cells[7]))


def parse_batched_bench(text: str) -> list[BatchedBenchRow]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            rows.append(_from_json(line))
        elif line.startswith("|"):
            row = _from_table(line)
            if row is not None:
                rows.append(row)
    return rows


def run_batched_bench(
    tool: Path, gguf: Path, threads: int, prompt_len: int, new_tokens: int, batches: list[int]
) -> dict[int, BatchedBenchRow]:
    cmd = batched_bench_command(tool, gguf, threads, prompt_len, new_tokens, batches)
    # OMP_NUM_THREADS would cap llama.cpp's OpenMP pool below -t; it gets exactly -t threads.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    for _ in range(RUNS_FOR_ROWS):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        rows = parse_batched_bench(done.stdout + "\n" + done.stderr)
        if done.returncode != 0 or {r.batch for r in rows} == set(batches):
            break  # a crash is not retried; a clean exit that lost rows is (see RUNS_FOR_ROWS)
    if done.returncode != 0 or {r.batch for r in rows} != set(batches):
        tail = "\n".join(done.stderr.splitlines()[-20:])
        raise RuntimeError(
            f"llama-batched-bench on {gguf.name} failed (exit {done.returncode}, rows for "
            f"batches {sorted(r.batch for r in rows)} of {batches}):\n{tail}"
        )
    return {r.batch: r for r in rows}
