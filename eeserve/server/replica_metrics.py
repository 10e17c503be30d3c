"""Every replica's metrics on one ``/metrics`` page, each sample labelled with its replica.

Contract: ``MetricsHub`` (a Ray actor in replica mode; a plain class here) keeps the latest
Prometheus page each replica pushed with ``put(replica, pid, text)``; ``pages()`` returns the
pages pushed within the last ``stale_after`` seconds (a dead replica's page ages out). It also
relays the ingress gate's view (``server.ingress``): ``put_state(state)`` keeps each replica's
latest ``ReplicaState``; ``exchange(refused)``, the gate's poll, keeps the gate's refusal counts
by type and returns the states put within the last ``ingress.STALE_S`` seconds;
``ingress_refused()`` returns those counts. ``merge_pages(pages, ingress_refused)`` renders them
as one exposition: every family once, every sample with a ``replica`` label,
``eeserve_replica_info{replica, pid} 1`` naming each replica's process, and the gate's refusals
as ``eeserve_ingress_rejected_total{type}``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from eeserve.server.ingress import STALE_S, ReplicaState


@dataclass
class ReplicaPage:
    replica: str
    pid: int
    text: str


class MetricsHub:
    def __init__(self, stale_after: float = 15.0) -> None:
        self.stale_after = stale_after
        self._pages: dict[str, tuple[ReplicaPage, float]] = {}
        self._states: dict[str, tuple[ReplicaState, float]] = {}
        self._refused: dict[str, int] = {}

    def put_state(self, state: ReplicaState) -> None:
        self._states[state.replica] = (state, time.monotonic())

    def exchange(self, refused: dict[str, int]) -> list[ReplicaState]:
        self._refused = dict(refused)
        now = time.monotonic()
        self._states = {k: v for k, v in self._states.items() if now - v[1] <= STALE_S}
        return [state for state, _ in self._states.values()]

    def ingress_refused(self) -> dict[str, int]:
        return dict(self._refused)

    def put(self, replica: str, pid: int, text: str) -> None:
        self._pages[replica] = (ReplicaPage(replica, pid, text), time.monotonic())

    def pages(self) -> list[ReplicaPage]:
        now = time.monotonic()
        self._pages = {k: v for k, v in self._pages.items() if now - v[1] <= self.stale_after}
        return [page for page, _ in sorted(self._pages.values(), key=lambda v: v[0].replica)]


def merge_pages(pages: list[ReplicaPage], ingress_refused: dict[str, int] | None = None) -> bytes:
    lines = [
        "# HELP eeserve_ingress_rejected Generation requests answered 429 by the ingress "
        "gate in Ray Serve's proxy, before reaching a replica, by the error's type",
        "# TYPE eeserve_ingress_rejected counter",
        *(
            f"eeserve_ingress_rejected_total{{{_labels({'type': k})}}} {float(v)!r}"
            for k, v in sorted((ingress_refused or {}).items())
        ),
        "# HELP eeserve_replica_info Engine replicas behind this endpoint (one process each)",
        "# TYPE eeserve_replica_info gauge",
    ]
    lines += [
        f"eeserve_replica_info{{{_labels({'replica': p.replica, 'pid': str(p.pid)})}}} 1.0"
        for p in pages
    ]
    families: dict[str, tuple[str, str, list[str]]] = {}
    for page in pages:
        for fam in text_string_to_metric_families(page.text):
            _, _, samples = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for s in fam.samples:
                labels = {**s.labels, "replica": page.replica}
                samples.append(f"{s.name}{{{_labels(labels)}}} {float(s.value)!r}")
    for name, (kind, doc, samples) in families.items():
        lines += [f"# HELP {name} {_escape(doc, quote=False)}", f"# TYPE {name} {kind}", *samples]
    return ("\n".join(lines) + "\n").encode()


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())


def _escape(value: str, quote: bool = True) -> str:
    value = value.replace("\\", "\\\\").replace("\n", "\\n")
    return value.replace('"', '\\"') if quote else value
