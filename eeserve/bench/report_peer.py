"""The llama.cpp section of ``eeserve bench report``: full depth against llama.cpp on the same
weights.

Contract: ``open_peer(run)`` starts a llama.cpp worker (``bench.llamacpp``) on the model's F32
GGUF (written once and cached), or says why the section is skipped: llama-cpp-python missing
(with the install hint), or an engine that is not float32 on CPU (llama.cpp's F32 is the same
arithmetic only there). ``peer_blocks`` gives, per batch size, one block timing the engine at
full depth and llama.cpp F32 side by side in the same interleaved repeats (an untimed pause
before each, as in ``--sections peer``, so that one runner's spinning threads are not charged to
the next); ``peer_rows`` turns them into decode tok/s, the ratio and llama.cpp's token agreement
and ROUGE-L against the engine's text (1.000: the same model); ``peer_section`` renders them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from eeserve.bench import llamacpp
from eeserve.bench.measure import Run, quality_vs
from eeserve.bench.report_blocks import Block, Job
from eeserve.bench.report_run import ReportRun
from eeserve.exit_params import ExitParams

LABEL = "llama.cpp F32"
# Untimed pause before each timed run of a peer block (see ``bench.peer``).
_SETTLE_S = 0.5


@dataclass
class Peer:
    """A running llama.cpp worker, or the reason the section is skipped."""

    worker: llamacpp.LlamaCpp | None = None
    skipped: str | None = None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def open_peer(run: ReportRun) -> Peer:
    if run.device.type != "cpu" or run.dtype != torch.float32:
        return Peer(
            skipped=f"llama.cpp F32 compares with float32 on CPU, not {run.dtype} on "
            f"{run.device.type}"
        )
    if not llamacpp.available():
        return Peer(skipped=f"llama-cpp-python is not installed; {llamacpp.INSTALL_HINT}")
    f32 = llamacpp.f32_gguf(run.folder)
    n = max(run.batch_sizes)
    max_len = max(len(p) for p in run.prompts[:n]) + run.cfg.max_tokens + 1
    threads = run.cfg.threads or torch.get_num_threads()
    worker = llamacpp.LlamaCpp(f32, threads, n, max_len)
    worker.run(run.prompts[:2], 4)  # warm-up
    return Peer(worker=worker)


def _settled(fn: Callable[[], Run]) -> Callable[[], Run]:
    def job() -> Run:
        time.sleep(_SETTLE_S)
        return fn()

    return job


def peer_blocks(run: ReportRun, peer: Peer) -> list[Block]:
    worker = peer.worker
    if worker is None:
        return []
    full = ExitParams(enabled=False)
    out = []
    for b in run.batch_sizes:
        jobs: list[Job] = [
            ("full", _settled(run.engine_job(run.first, b, full))),
            (LABEL, _settled(partial(worker.run, run.prompts[:b], run.cfg.max_tokens))),
        ]
        out.append(Block(f"llama.cpp, batch {b}", b, jobs))
    return out


def peer_rows(run: ReportRun, blocks: list[Block]) -> list[dict[str, Any]]:
    rows = []
    for block in blocks:
        med = block.median()
        full, peer = med["full"], med[LABEL]
        agree, rouge = quality_vs(full, peer, run.tokenizer)
        rows.append(
            {
                "batch": block.batch,
                "engine_decode_tok_s": full.decode_tokens_per_s,
                "llamacpp_decode_tok_s": peer.decode_tokens_per_s,
                "engine_vs_llamacpp": full.decode_tokens_per_s / peer.decode_tokens_per_s,
                "token_agreement": agree,
                "rouge_l": rouge,
            }
        )
    return rows


def peer_section(results: dict[str, Any]) -> str:
    peer = results["peer"]
    head = "## llama.cpp\n\n"
    if "skipped" in peer:
        return head + f"Skipped: {peer['skipped']}."
    lines = [
        "| batch | eeserve full depth tok/s | llama.cpp F32 tok/s | eeserve / llama.cpp "
        "| llama.cpp vs eeserve: agreement / ROUGE-L |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in peer["rows"]:
        lines.append(
            f"| {r['batch']} | {r['engine_decode_tok_s']:.1f} | {r['llamacpp_decode_tok_s']:.1f} "
            f"| {r['engine_vs_llamacpp']:.2f}× | {r['token_agreement']:.3f} / {r['rouge_l']:.3f} |"
        )
    return (
        head + "Decode tokens/s of the engine at full depth and of llama.cpp (llama-cpp-python, "
        "its own process) on the same weights written as an F32 GGUF, the same prompts, token "
        "counts and threads, measured side by side. Agreement 1.000 means the same greedy text."
        "\n\n" + "\n".join(lines)
    )
