"""Training a base delta (``tune-exits --train-base lora``): the model itself learns to exit.

Contract: ``train_base_delta(model, groups, exit_layers, opts, checkpoints)`` attaches low-rank
adapters (``A`` [r, in], random; ``B`` [out, r], zero; scaled by ``lora_alpha / lora_rank``) to
every HF projection of every decoder layer (q/k/v share the fused ``qkv_proj``, gate/up the fused
``gate_up_proj``: each keeps its own A/B on its rows), trains them jointly with linear exit heads
(``heads.init_heads``) by distillation from the frozen original and returns the delta
(``models.base_delta.BaseDelta``) and its training statistics; the model's modules and weights are
left as they were (the caller merges the delta). Loss per step (CALM's layer-weighted loss):
``(sum_l w_l KL(orig || exit_l) + final_weight KL(orig || variant final)) / (sum_l w_l +
final_weight)``, every KL over ``heads.candidates`` (sampled vocabulary), the teacher computed in
the same step with the adapters switched off. Steps are batches of whole groups up to
``base_batch_tokens`` tokens, every position trained. Deterministic for a seed and thread count;
checkpointed every ``checkpoint_every`` steps in ``checkpoints`` and resumed from there (a
finished run is loaded, not retrained). Runs on ``opts.device`` ("auto": CUDA when present).
Given held-out groups, a point of the training curve (``tuning.delta_curve``) is measured before
the first step, every ``eval_every`` steps and after the last. ``lora_lr=0`` freezes the base (the
delta stays zero, no gradient flows through the layers): the heads-only baseline of the same run.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from eeserve.models.base_delta import (
    PROJECTIONS,
    BaseDelta,
    ProjectionSlot,
    delta_key,
    projection_slots,
)
from eeserve.models.config import rope_tables
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import ExitHeads
from eeserve.models.llama import LlamaForCausalLM
from eeserve.tuning.data import exit_states, pack_groups
from eeserve.tuning.delta_curve import CurveProbe
from eeserve.tuning.groups import Group
from eeserve.tuning.heads import candidates, init_heads, sampled_kl, schedule
from eeserve.tuning.options import TuneOptions

CHECKPOINT = "delta.pt"


class LoraLinear(nn.Module):
    """A frozen (possibly fused) linear plus one low-rank correction per HF projection, each on
    its own block of output rows (blocks in row order, covering every row)."""

    def __init__(
        self,
        base: nn.Linear,
        slots: list[ProjectionSlot],
        rank: int,
        scale: float,
        gen: torch.Generator,
    ) -> None:
        super().__init__()
        self.base = base
        self.scale = scale
        self.enabled = True
        bound = [1 / math.sqrt(s.cols) for s in slots]  # PEFT's A init: U(+-1/sqrt(in))
        dtype = base.weight.dtype
        self.a = nn.ParameterList(
            ((torch.rand(rank, s.cols, generator=gen) * 2 - 1) * b).to(dtype)
            for s, b in zip(slots, bound)
        )
        self.b = nn.ParameterList(torch.zeros(s.rows, rank, dtype=dtype) for s in slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.enabled:
            return y  # type: ignore[no-any-return]
        parts = [(x @ a.T) @ b.T for a, b in zip(self.a, self.b)]  # [N, r] -> [N, rows]
        return y + self.scale * torch.cat(parts, dim=-1)  # type: ignore[no-any-return]


@dataclass
class Adapters:
    model: LlamaForCausalLM
    modules: dict[tuple[int, str], LoraLinear]  # (layer, module path) -> adapter
    names: dict[tuple[int, str], list[str]]  # the HF projections of each, in row order
    rank: int
    scale: float

    def enable(self, on: bool) -> None:
        for m in self.modules.values():
            m.enabled = on

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules.values() for p in (*m.a, *m.b)]

    def delta(self) -> BaseDelta:
        tensors: dict[str, torch.Tensor] = {}
        for (i, path), m in self.modules.items():
            for proj, a, b in zip(self.names[(i, path)], m.a, m.b):
                tensors[f"{delta_key(i, proj)}.lora_A"] = a.detach().float().cpu()
                tensors[f"{delta_key(i, proj)}.lora_B"] = b.detach().float().cpu()
        return BaseDelta(self.rank, self.scale, tensors)

    def remove(self) -> None:
        """Put the model's own linears back (the adapters keep their weights)."""
        for (i, path), m in self.modules.items():
            parent, _, attr = path.rpartition(".")
            setattr(self.model.layers[i].get_submodule(parent), attr, m.base)


def attach_adapters(model: LlamaForCausalLM, rank: int, scale: float, seed: int) -> Adapters:
    """Wrap every projection module of every layer in a ``LoraLinear`` (random A, zero B)."""
    slots = projection_slots(model.config)
    by_module: dict[str, list[str]] = {}
    for proj in PROJECTIONS:
        by_module.setdefault(slots[proj].module, []).append(proj)
    gen = torch.Generator().manual_seed(seed)
    modules: dict[tuple[int, str], LoraLinear] = {}
    names: dict[tuple[int, str], list[str]] = {}
    for i, layer in enumerate(model.layers):
        for path, projs in by_module.items():
            parent, _, attr = path.rpartition(".")
            base = layer.get_submodule(path)
            assert isinstance(base, nn.Linear), "adapters need an unpacked model (load_model)"
            wrapped = LoraLinear(base, [slots[p] for p in projs], rank, scale, gen)
            wrapped.to(base.weight.device)
            setattr(layer.get_submodule(parent), attr, wrapped)
            modules[(i, path)], names[(i, path)] = wrapped, projs
    return Adapters(model, modules, names, rank, scale)


def plan_batches(groups: list[Group], budget: int, seed: int) -> list[list[int]]:
    """Group indices per step: a seeded shuffle, packed greedily up to ``budget`` tokens."""
    order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
    batches: list[list[int]] = []
    size = 0
    for i in order:
        n = groups[i].num_tokens
        if not batches or size + n > budget:
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += n
    return batches


def layer_weights(opts: TuneOptions, layers: list[int], num_layers: int) -> list[float]:
    if opts.layer_weights is None:
        return [lay / num_layers for lay in layers]  # CALM: deeper exits weigh more
    if len(opts.layer_weights) != len(layers) or min(opts.layer_weights) < 0:
        raise ValueError(
            f"layer_weights: want {len(layers)} non-negative weights (one per exit layer "
            f"{layers}), got {opts.layer_weights}"
        )
    return list(opts.layer_weights)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class _Step:
    """What one training step needs besides its groups."""

    model: LlamaForCausalLM
    adapters: Adapters
    heads: ExitHeads
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin tables [max_len, head_dim]
    weights: list[float]
    opts: TuneOptions
    gen: torch.Generator  # CPU: the sampled vocabulary's negatives

    @property
    def trains_base(self) -> bool:
        return self.opts.lora_lr > 0


def step_loss(step: _Step, part: list[Group]) -> tuple[torch.Tensor, list[float], float]:
    """The weighted distillation loss of one batch; also each exit's KL and the final KL."""
    layers = step.heads.config.exit_layers
    lm_w = step.model.lm_head.weight.detach()
    packed = pack_groups(part, True, True).to(lm_w.device)
    with torch.no_grad():
        step.adapters.enable(False)
        frozen_hidden, teacher = exit_states(
            step.model, packed, step.rope, [] if step.trains_base else layers
        )
        step.adapters.enable(True)
        top = torch.cat([(t @ lm_w.T).topk(step.opts.topk, -1).indices for t in teacher.split(512)])
    cand = candidates(top.cpu(), lm_w.shape[0], step.opts.negatives, step.gen).to(lm_w.device)
    if step.trains_base:
        hidden, final = exit_states(step.model, packed, step.rope, layers)
    else:  # a zero delta: the student's states are the teacher's
        hidden, final = frozen_hidden, teacher
    exit_kl = [
        sampled_kl(step.heads.normed(lay, hidden[lay]), teacher, lm_w, cand) for lay in layers
    ]
    final_kl = sampled_kl(final, teacher, lm_w, cand)
    fw = step.opts.final_weight
    total = sum(w * kl for w, kl in zip(step.weights, exit_kl)) + fw * final_kl
    loss = total / (sum(step.weights) + fw)
    return loss, [float(k.detach()) for k in exit_kl], float(final_kl.detach())


def train_base_delta(
    model: LlamaForCausalLM,
    groups: list[Group],
    exit_layers: list[int],
    opts: TuneOptions,
    checkpoints: Path | None = None,
    heldout: list[Group] | None = None,
) -> tuple[BaseDelta, dict[str, Any]]:
    """Train the delta (see the module docstring); ``model`` is returned to the CPU unchanged.
    ``heldout``: the groups the training curve is measured on (none: no curve)."""
    device = resolve_device(opts.device)
    cfg = ExitConfig(model.config.num_layers, exit_layers, head="tuned", adapter="linear")
    heads = init_heads(cfg, model).to(device)
    model.to(device)
    adapters = attach_adapters(model, opts.lora_rank, opts.lora_alpha / opts.lora_rank, opts.seed)
    try:
        probe = CurveProbe(heldout, opts.base_batch_tokens) if heldout and opts.eval_every else None
        stats = _train(model, adapters, heads, groups, opts, checkpoints, probe)
    finally:
        adapters.remove()
        model.to("cpu")
    return adapters.delta(), stats


def _train(
    model: LlamaForCausalLM,
    adapters: Adapters,
    heads: ExitHeads,
    groups: list[Group],
    opts: TuneOptions,
    checkpoints: Path | None,
    probe: CurveProbe | None,
) -> dict[str, Any]:
    layers = heads.config.exit_layers
    batches = plan_batches(groups, opts.base_batch_tokens, opts.seed)
    opt, sched = _optimizer(adapters, heads, opts, len(batches))
    max_len = max(g.num_tokens for g in [*groups, *(probe.groups if probe else [])])
    rope = tuple(t.to(next(model.parameters()).device) for t in rope_tables(model.config, max_len))
    weights = layer_weights(opts, layers, model.config.num_layers)
    step = _Step(model, adapters, heads, (rope[0], rope[1]), weights, opts, torch.Generator())
    step.gen.manual_seed(opts.seed)
    log: dict[str, Any] = {"loss": [], "exit_kl": [], "final_kl": [], "tokens": 0, "seconds": 0.0}
    log["curve"] = []
    ckpt = checkpoints / CHECKPOINT if checkpoints else None
    start = _resume(ckpt, adapters, heads, opt, sched, step.gen, log)
    if probe is not None and not log["curve"]:
        _curve_point(step, probe, log)
    sizes = [sum(groups[i].num_tokens for i in b) for b in batches]
    bar = tqdm(total=sum(sizes), initial=sum(sizes[:start]), desc="base delta", unit="tok")
    for n in range(start, len(batches)):
        t0 = time.perf_counter()
        loss, exit_kl, final_kl = step_loss(step, [groups[i] for i in batches[n]])
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        sched.step()
        log["loss"].append(float(loss.detach()))
        log["exit_kl"].append(exit_kl)
        log["final_kl"].append(final_kl)
        log["tokens"] += sizes[n]
        log["seconds"] += time.perf_counter() - t0
        bar.update(sizes[n])
        bar.set_postfix(loss=f"{log['loss'][-1]:.3f}", final_kl=f"{final_kl:.3f}")
        if probe is not None and ((n + 1) % opts.eval_every == 0 or n + 1 == len(batches)):
            _curve_point(step, probe, log)
        if ckpt is not None and ((n + 1) % opts.checkpoint_every == 0 or n + 1 == len(batches)):
            _save(ckpt, n + 1, adapters, heads, opt, sched, step.gen, log)
    bar.close()
    return _summary(log, layers, len(batches))


def _optimizer(
    adapters: Adapters, heads: ExitHeads, opts: TuneOptions, steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the joint heads (their probes aside) and, when ``lora_lr`` > 0, the base delta
    at that rate (else the delta stays frozen), its rate following ``schedule`` over ``steps``."""
    head_params = [p for n, p in heads.named_parameters() if not n.startswith("classifier")]
    groups: list[dict[str, Any]] = [{"params": head_params}]
    if opts.lora_lr > 0:
        groups.append({"params": adapters.parameters(), "lr": opts.lora_lr})
    else:
        for p in adapters.parameters():
            p.requires_grad_(False)
    opt = torch.optim.AdamW(
        groups,
        lr=opts.joint_head_lr,  # the auxiliary heads: raw inputs, unlike ``heads.train_head``
        weight_decay=0.0,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, steps))
    return opt, sched


def _curve_point(step: _Step, probe: CurveProbe, log: dict[str, Any]) -> None:
    point = probe.point(step.model, step.heads, step.adapters.enable, step.rope)
    log["curve"].append({"tokens": log["tokens"], **point})
    tqdm.write(f"curve at {log['tokens']} tokens: {point}")


def _save(
    path: Path,
    done: int,
    adapters: Adapters,
    heads: ExitHeads,
    opt: Any,
    sched: Any,
    gen: Any,
    log: Any,
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "step": done,
        "adapters": [p.detach().cpu() for p in adapters.parameters()],
        "heads": {k: v.cpu() for k, v in heads.state_dict().items()},
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
        "gen": gen.get_state(),
        "log": log,
    }
    tmp = path.with_suffix(".partial")
    torch.save(state, tmp)
    tmp.rename(path)


def _resume(
    path: Path | None,
    adapters: Adapters,
    heads: ExitHeads,
    opt: Any,
    sched: Any,
    gen: Any,
    log: Any,
) -> int:
    """Load a checkpoint into the training state; returns the step to continue from."""
    if path is None or not path.exists():
        return 0
    state = torch.load(path, weights_only=True)
    with torch.no_grad():
        for p, saved in zip(adapters.parameters(), state["adapters"]):
            p.copy_(saved)
    heads.load_state_dict(state["heads"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    gen.set_state(state["gen"])
    log.update(state["log"])
    return int(state["step"])


def _summary(log: dict[str, Any], layers: list[int], steps: int) -> dict[str, Any]:
    def avg(xs: list[float]) -> float:
        return sum(xs) / max(1, len(xs))

    k = max(1, min(10, steps // 3))  # first and last steps do not overlap
    first, last = log["exit_kl"][:k], log["exit_kl"][-k:]
    return {
        "steps": steps,
        "tokens": log["tokens"],
        "seconds": log["seconds"],
        "tokens_per_s": log["tokens"] / max(1e-9, log["seconds"]),
        "first_loss": avg(log["loss"][:k]),
        "last_loss": avg(log["loss"][-k:]),
        "exit_kl_first": {str(lay): avg([r[e] for r in first]) for e, lay in enumerate(layers)},
        "exit_kl_last": {str(lay): avg([r[e] for r in last]) for e, lay in enumerate(layers)},
        "final_kl_last": avg(log["final_kl"][-k:]),
        "final_kl_max": max(log["final_kl"], default=0.0),
        "curve": log["curve"],
    }
