"""The arithmetic and the printout of ``--sections peer``: interleaved ratios and the roofline.

Contract: a round is ``{batch: {runner label: decode tok/s}}`` for every runner, timed back to
back. ``round_ratios(round, pairs)`` gives each pair's ratio ``engine / llama.cpp`` within that
round (pairs whose runners are missing are left out); ``spread(values)`` is the median, min and
max of a list; ``summarise(rounds, pairs)`` turns all rounds into one row per batch size: each
runner's median tok/s and each pair's median ratio with its min/max over rounds (the median of
per-round ratios, not the ratio of medians: a load swing that hits both runners of a round
cancels out). ``roofline_rows(rounds, bandwidths, bytes_per_token)`` gives, at batch 1, each
runner's median tok/s and its fraction of its ceiling ``bandwidth / bytes per token``, one
fraction per round against that round's own bandwidth probe. ``print_summary`` prints both.
"""

from __future__ import annotations

import statistics
from typing import Any

from eeserve.bench.roofline import fraction_of_roofline

Round = dict[int, dict[str, float]]  # batch -> runner label -> decode tok/s
Pair = tuple[str, str]  # (this engine's label, llama.cpp's label)


def pair_name(pair: Pair) -> str:
    return f"{pair[0]} / {pair[1]}"


def spread(values: list[float]) -> dict[str, float]:
    if not values:
        raise ValueError("spread of no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def round_ratios(one: Round, pairs: list[Pair]) -> dict[int, dict[str, float]]:
    return {
        batch: {pair_name(p): tps[p[0]] / tps[p[1]] for p in pairs if p[0] in tps and p[1] in tps}
        for batch, tps in one.items()
    }


def summarise(rounds: list[Round], pairs: list[Pair]) -> list[dict[str, Any]]:
    rows = []
    for batch in sorted(rounds[0]):
        labels = list(rounds[0][batch])
        per_round = [round_ratios(r, pairs)[batch] for r in rounds]
        ratios = {}
        for name in per_round[0]:
            values = [r[name] for r in per_round]
            ratios[name] = {**spread(values), "per_round": values}
        rows.append(
            {
                "batch": batch,
                "decode_tok_s_median": {
                    label: statistics.median(r[batch][label] for r in rounds) for label in labels
                },
                "ratios": ratios,
            }
        )
    return rows


def roofline_rows(
    rounds: list[Round], bandwidths: list[float], bytes_per_token: dict[str, int]
) -> list[dict[str, Any]]:
    """Batch-1 fraction of the roofline per runner whose bytes per token are known."""
    rows = []
    for label, nbytes in bytes_per_token.items():
        tps = [r[1][label] for r in rounds if 1 in r and label in r[1]]
        if not tps:
            continue
        fractions = [fraction_of_roofline(t, bw, nbytes) for t, bw in zip(tps, bandwidths)]
        rows.append(
            {
                "runner": label,
                "bytes_per_token": nbytes,
                "ceiling_tok_s_median": statistics.median(bw / nbytes for bw in bandwidths),
                "decode_tok_s_median": statistics.median(tps),
                "fraction": spread(fractions),
            }
        )
    return rows


def print_summary(rows: list[dict[str, Any]], roofline: list[dict[str, Any]], rounds: int) -> None:
    print(f"\ndecode tok/s, medians of {rounds} interleaved rounds; ratios: median [min-max]")
    for row in rows:
        tps = "  ".join(f"{k} {v:.1f}" for k, v in row["decode_tok_s_median"].items())
        print(f"batch {row['batch']:3d}: {tps}")
        for name, r in row["ratios"].items():
            print(f"    {name}: {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]")
    if roofline:
        print("batch-1 roofline (bandwidth / bytes of weights read per token):")
    for r in roofline:
        f = r["fraction"]
        print(
            f"    {r['runner']}: {r['bytes_per_token'] / 1e6:.0f} MB/token, ceiling "
            f"{r['ceiling_tok_s_median']:.1f} tok/s, measured {r['decode_tok_s_median']:.1f} "
            f"tok/s = {f['median']:.0%} [{f['min']:.0%}-{f['max']:.0%}] of the roofline",
            flush=True,
        )
