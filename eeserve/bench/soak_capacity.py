"""The soak's 1x rate: given, or measured as a share of the server's saturation throughput.

Contract: ``measure_capacity(args, client, mix, t0, hard_timeout)`` returns the capacity record:
``requests_per_s`` (the 1x rate), ``throughput_per_s`` (the saturation throughput measured, or
None), ``utilization`` (the share of it taken as 1x, or None), ``measured`` and ``closed_loop``
(the measuring loop's outcomes by status; empty when not measured). With ``--capacity`` it takes
that rate as given and sends nothing (``given_capacity``; a run that needs no 1x rate records
None). Otherwise it runs a closed loop of
``--capacity-concurrency`` clients sending the request mix for ``--capacity-duration`` seconds;
the saturation throughput is the completed requests over the time from the loop's start to the
last completion, and the 1x rate ``--utilization`` of it. It raises ``RuntimeError`` when no
request completed.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from eeserve.bench.soak_load import LoadClient, Mix, closed_loop, status_counts


def given_capacity(rate: float | None) -> dict[str, Any]:
    """The capacity record of a 1x rate taken as given (None: the run needs none)."""
    return {
        "requests_per_s": rate,
        "throughput_per_s": None,
        "utilization": None,
        "measured": False,
        "closed_loop": {},
    }


async def measure_capacity(
    args: argparse.Namespace,
    client: LoadClient,
    mix: Mix,
    t0: float,
    hard_timeout: float,
) -> dict[str, Any]:
    """The capacity record (see the module docstring)."""
    if args.capacity is not None:
        return given_capacity(args.capacity)
    start = time.perf_counter() - t0
    outs = await closed_loop(
        client, mix, args.capacity_concurrency, args.capacity_duration, t0, hard_timeout
    )
    counts = status_counts(outs)
    done = [o for o in outs if o.status == "completed"]
    if not done:
        raise RuntimeError(f"no request completed while measuring capacity: {counts}")
    # The requests in flight when the loop stops run to their end and count: a window that
    # counted only completions inside it would miss every request longer than the window.
    rate = len(done) / (max(o.ended for o in done) - start)
    capacity = args.utilization * rate
    print(
        f"saturation throughput: {rate:.3f} requests/s ({counts}); "
        f"capacity (1x): {capacity:.3f} requests/s",
        flush=True,
    )
    return {
        "requests_per_s": capacity,
        "throughput_per_s": rate,
        "utilization": args.utilization,
        "measured": True,
        "closed_loop": counts,
    }
