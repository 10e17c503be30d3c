"""Exit checks: the exit heads' inputs, logits and confidence at one exit layer.

Contract: ``ExitChecks.confidence(measure, layer, h, h_prev)`` gives the confidence [n] of the
rows h [n, D] at exit ``layer`` under ``measure`` (definitions: ``measures.confidence``), and the
exit logits [n, V] when the measure computed them (the full-vocabulary measures: a leaving row's
token comes from them). The exit loop, ``eeserve bench checks`` and the teacher-forced scores all
check through here, so that they time and score the same arithmetic.

A shortlist check (``Shortlist``) is the exit head restricted to K rows of the LM head, in
as few calls as its head allows: for a tuned head with a ``linear`` adapter, ``h + A h + b`` is
one projection by ``I + A``; the head norm's weight is multiplied into the K rows, so the norm is
a bare RMS normalisation; then the rows' projection, softmax and top two. Same numbers as
``shortlist rows(norm(adapter(h)))`` up to float rounding (docs/early-exit.md, "Cost of a check").
``stack_check(measure, layer)`` gives the same check in the terms of the kernel that runs it
between layers (``kernels.fused.StackCheck``), where its parts run on the engine's kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from eeserve.engine.measures import confidence
from eeserve.exit_params import LOGIT_MEASURES, SHORTLIST_MEASURES, Measure
from eeserve.kernels.fused import STACK_MEASURES, StackCheck
from eeserve.models.config import ModelConfig
from eeserve.models.cost import CostModel
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import ExitHeads
from eeserve.models.llama import LlamaForCausalLM, RMSNorm

# (weight [K, D], bias [K] | None) -> a module computing x [n, D] -> x W^T + b [n, K], in the
# runner's weight format (packed, int8 or dense)
LinearFn = Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
# An RMS norm -> the module that computes it on the runner's kernels (native or PyTorch's)
NormFn = Callable[[RMSNorm], nn.Module]


@dataclass(frozen=True)
class ShortlistHead:
    """One exit layer's shortlist logits: rows(rms(pre(h))). ``pre`` maps the head input to the
    norm's input (None: it is the head input); ``rms`` is an RMS norm of unit weight; ``rows``
    holds the K LM-head rows times the head norm's weight."""

    pre: nn.Module | None
    rms: nn.Module
    rows: nn.Module

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, D] -> [n, K] float32."""
        x = h if self.pre is None else self.pre(h)
        return self.rows(self.rms(x)).float()  # type: ignore[no-any-return]


@dataclass(frozen=True, kw_only=True)
class Shortlist:
    """Shortlist checks over the LM-head rows ``weight`` [K, D] at every exit layer. ``linear``
    and ``norm`` build the runner's projections and norms; ``fold_adapter``: a tuned head's
    ``linear`` adapter may become one projection (float weights; not where it is quantised)."""

    weight: torch.Tensor
    linear: LinearFn
    norm: NormFn
    fold_adapter: bool


class ExitChecks:
    def __init__(
        self,
        *,
        model: LlamaForCausalLM,
        lm_head: nn.Module,
        heads: ExitHeads | None,
        shared_head: bool,
        shortlist: Shortlist | None = None,
    ) -> None:
        self.model = model
        self.lm_head = lm_head
        self.heads = heads
        self.shared_head = shared_head
        # Per exit layer (tuned heads), or one for every layer (the shared head).
        self._shortlist: dict[int, ShortlistHead] = {}
        self._shared_shortlist: ShortlistHead | None = None
        self.shortlist_rows = 0  # K: 0 without a shortlist
        # Exit layer -> its classifier probe's (weight [D], bias [1]) where the probe is a float
        # nn.Linear: a matrix-vector product, not a one-column GEMM (measured several times
        # slower between the layers' kernels, at batch 1).
        self._probes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if heads is not None and heads.config.classifier:
            for layer in heads.config.exit_layers:
                clf = heads.head(layer).classifier
                if isinstance(clf, nn.Linear) and clf.bias is not None:
                    self._probes[layer] = (clf.weight.detach()[0], clf.bias.detach())
        # (measure, exit layer) -> its check for decode_stack_checked, or None: built on first use.
        self._stack_checks: dict[tuple[str, int], StackCheck | None] = {}
        if shortlist is not None:
            self._use_shortlist(shortlist)

    def head_normed(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """LM-head input [n, D] of exit ``layer`` (1-based) from the head's input [n, D]: the
        hidden state after ``layer``, or for layer heads h_mid of layer ``layer`` + 1."""
        if self.shared_head or self.heads is None:
            return self.model.final_norm(h)
        return self.heads.normed(layer, h)

    def head_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Exit logits [n, V] (float32) of exit ``layer``; see ``head_normed``."""
        return self.lm_head(self.head_normed(layer, h)).float()  # type: ignore[no-any-return]

    def measure_logits(self, measure: str, layer: int, h: torch.Tensor) -> torch.Tensor | None:
        """The logits [n, V] (shortlist measures: [n, K]) that ``measure`` reads at exit
        ``layer`` from the head's input h [n, D]; None for measures that read none."""
        if measure in LOGIT_MEASURES:
            return self.head_logits(layer, h)
        if measure in SHORTLIST_MEASURES:
            head = self._shortlist.get(layer, self._shared_shortlist)
            if head is None:
                raise ValueError(f"measure {str(measure)!r} needs the exit sidecar's shortlist")
            return head.logits(h)
        return None

    def confidence(
        self, measure: str, layer: int, h: torch.Tensor, h_prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Confidence [n] of rows h [n, D] at exit ``layer`` (h_prev [n, D]: the hidden state
        ``hidden_cosine`` compares with), and the exit logits [n, V] of the full-vocabulary
        measures (None for the others)."""
        logits = self.measure_logits(measure, layer, h)
        probe = None
        if measure == Measure.CLASSIFIER:
            if self.heads is None:
                raise ValueError("measure 'classifier' needs classifier probes in the exit sidecar")
            vec = self._probes.get(layer)
            probe = self.heads.probe(layer, h) if vec is None else torch.addmv(vec[1], h, vec[0])
        conf = confidence(measure, logits, h, h_prev, probe)
        return conf, logits if measure in LOGIT_MEASURES else None

    def allowed_confidence(
        self, measure: str, layer: int, h: torch.Tensor, allowed: list[torch.Tensor]
    ) -> list[float]:
        """Confidence of rows h [n, D] at exit ``layer`` over each row's allowed tokens alone
        (``allowed[i]``: ids [k_i]): the exit head's logits at those ids, softmaxed among
        themselves; the margin of the top two for the margin measures, else the top probability
        (a lone allowed token: 1)."""
        normed = self.head_normed(layer, h).float()  # [n, D]
        weight = self.model.lm_head.weight
        margin = measure in (Measure.SOFTMAX_MARGIN, Measure.SHORTLIST_MARGIN)
        out = []
        for i, ids in enumerate(allowed):
            logits = weight[ids].float() @ normed[i]  # [k]
            if logits.numel() == 1:
                out.append(1.0)
                continue
            top = logits.softmax(-1).topk(2).values
            out.append(float(top[0] - top[1]) if margin else float(top[0]))
        return out

    def stack_check(self, measure: str, layer: int) -> StackCheck | None:
        """``measure``'s check at exit ``layer`` for the kernel that checks between layers;
        None where that kernel cannot compute it (other measures, modules off its kernels)."""
        key = (measure, layer)
        if key not in self._stack_checks:
            self._stack_checks[key] = self._build_stack_check(measure, layer)
        return self._stack_checks[key]

    def _build_stack_check(self, measure: str, layer: int) -> StackCheck | None:
        if measure not in STACK_MEASURES:
            return None
        if measure == Measure.CLASSIFIER:
            vec = self._probes.get(layer)
            ok = vec is not None and vec[0].dtype == torch.float32 and vec[0].device.type == "cpu"
            return StackCheck.classifier(vec[0], vec[1]) if ok and vec is not None else None
        head = self._shortlist.get(layer, self._shared_shortlist)
        return None if head is None else StackCheck.shortlist(head.pre, head.rms, head.rows)

    def _use_shortlist(self, shortlist: Shortlist) -> None:
        weight, linear, norm = shortlist.weight, shortlist.linear, shortlist.norm
        self.shortlist_rows = weight.shape[0]

        def unit_norm(eps: float) -> nn.Module:
            rms = RMSNorm(weight.shape[1], eps).to(weight.device, weight.dtype)
            return norm(rms.requires_grad_(False))

        if self.shared_head or self.heads is None:
            scale, eps = _norm_parts(self.model.model.get_submodule("norm"))
            rows = linear(_scaled(weight, scale), None)
            self._shared_shortlist = ShortlistHead(None, unit_norm(eps), rows)
            return
        for layer in self.heads.config.exit_layers:
            head = self.heads.head(layer)
            pre: nn.Module | None = head.adapter
            if head.adapter.kind == "none":
                pre = None
            elif head.adapter.kind == "linear" and shortlist.fold_adapter:
                pre = _identity_folded(head.adapter.layers[0], linear)
            scale, eps = _norm_parts(head.norm)
            rows = linear(_scaled(weight, scale), None)
            self._shortlist[layer] = ShortlistHead(pre, unit_norm(eps), rows)


def _norm_parts(norm: nn.Module) -> tuple[torch.Tensor, float]:
    """An RMS norm's weight [D] and epsilon (``RMSNorm`` or its native twin)."""
    weight, eps = norm.weight, norm.eps
    assert isinstance(weight, torch.Tensor) and isinstance(eps, float)
    return weight.detach(), eps


def _scaled(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """LM-head rows [K, D] times a norm's weight [D]: rows(w * x) = (rows * w)(x)."""
    return (weight.detach() * scale.to(weight.dtype)).contiguous()


def _identity_folded(lin: nn.Module, linear: LinearFn) -> nn.Module:
    """``h + lin(h)`` as one projection: weight I + W, the same bias."""
    assert isinstance(lin, nn.Linear), "a linear adapter to fold must be an nn.Linear"
    w = lin.weight.detach()
    eye = torch.eye(w.shape[0], dtype=w.dtype, device=w.device)
    bias = None if lin.bias is None else lin.bias.detach()
    return linear((w + eye).contiguous(), bias)


def shortlist_rows(cfg: ExitConfig, model: ModelConfig, heads: ExitHeads | None) -> int:
    """Shortlist rows a check reads: the sidecar's ``shortlist_size``, else what the check
    budget allows beside the exit head's adapter (``CostModel.shortlist_rows``)."""
    if cfg.shortlist_size > 0:
        return min(cfg.shortlist_size, len(cfg.shortlist))
    adapter = 0
    if heads is not None and cfg.head == "tuned":
        head = heads.head(cfg.exit_layers[0])
        adapter = sum(p.numel() for n, p in head.named_parameters() if "classifier" not in n)
    rows = CostModel.of(model, adapter).shortlist_rows(model.hidden_size)
    return min(rows, len(cfg.shortlist))
