"""Exit heads and their sidecar files (``exit_config.json`` + ``exit_heads.safetensors``).

Contract: ``ExitHeads`` holds, per exit layer, an optional own RMSNorm and adapter (``tuned``
heads) and an optional classifier probe; the vocabulary projection is always the model's own,
frozen LM head, passed in by the caller. ``load_sidecar``/``save_sidecar`` read and write the
format documented in docs/ (version 2; version 1, without a base delta, still loads). The base
model's weight files are never touched; a version-2 sidecar of a model trained to exit carries a
base delta (``models.base_delta``) that ``load_exit_setup`` merges into the loaded model.

Adapter kinds: ``none|linear|lowrank|mlp`` are residual adapters applied to h_l, the hidden state
after exit layer l. ``layer`` (EE-Tuning's "layer" head) is decoder layer l + 1 with its
attention frozen and shared with the base model: the head's input is h_mid, layer l + 1's state
between its attention and MLP halves (computed by the base layer, so the K/V it writes are the
ones layer l + 1 caches anyway: no KV cache of its own), and its adapter is a trainable copy of
that layer's post-attention RMSNorm + SwiGLU MLP (``adapter_rank`` = the MLP width, weights
``adapter.post_attention_layernorm.weight``, ``adapter.mlp.gate_up_proj.weight`` (gate rows
first), ``adapter.mlp.down_proj.weight``). Hence ``normed(l, h_mid)`` = ``norm(h_mid +
mlp(post_norm(h_mid)))``, and a ``layer`` head needs exit layers <= L - 2 (layer l + 1 must
exist below the final layer). Its classifier probe reads h_mid too.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from eeserve.models.base_delta import DELTA_NAME, BaseDelta, apply_sidecar_delta, save_base_delta
from eeserve.models.exit_config import ExitConfig, default_shared_exit_layers
from eeserve.models.llama import LlamaForCausalLM, LlamaMLP, RMSNorm

CONFIG_NAME = "exit_config.json"
WEIGHTS_NAME = "exit_heads.safetensors"
FORMAT = "eeserve-exit-heads/2"
FORMATS = ("eeserve-exit-heads/1", FORMAT)  # what loads; 2 added the base delta
ADAPTERS = ("none", "linear", "lowrank", "mlp", "layer")


def max_exit_layer(adapter: str, num_layers: int) -> int:
    """Deepest exit layer a head of kind ``adapter`` can serve (a ``layer`` head uses l + 1)."""
    return num_layers - 2 if adapter == "layer" else num_layers - 1


class Adapter(nn.Module):
    """Residual adapter ``h + f(h)``, initialised to the identity (f = 0), except ``layer``:
    f = a decoder layer's MLP half (``rank`` = MLP width), which the caller fills from the base
    model (``tuning.layer_heads.init_layer_heads``)."""

    def __init__(self, kind: str, dim: int, rank: int, eps: float = 1e-5) -> None:
        super().__init__()
        if kind not in ADAPTERS:
            raise ValueError(f"adapter must be one of {ADAPTERS}, got {kind!r}")
        self.kind = kind
        self.layers = nn.ModuleList()
        self.post_attention_layernorm: RMSNorm | None = None
        self.mlp: LlamaMLP | None = None
        if kind == "layer":
            if rank < 1:
                raise ValueError("a 'layer' exit head needs adapter_rank = the model's MLP width")
            self.post_attention_layernorm = RMSNorm(dim, eps)
            self.mlp = LlamaMLP(dim, rank)
        elif kind == "linear":
            self.layers.append(nn.Linear(dim, dim))
        elif kind in ("lowrank", "mlp"):
            self.layers.append(nn.Linear(dim, rank, bias=kind == "mlp"))
            self.layers.append(nn.Linear(rank, dim, bias=kind == "mlp"))
        if len(self.layers):
            last = self.layers[-1]
            assert isinstance(last, nn.Linear)
            nn.init.zeros_(last.weight)
            if last.bias is not None:
                nn.init.zeros_(last.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "none":
            return h
        if self.kind == "linear":
            return h + self.layers[0](h)
        if self.mlp is not None and self.post_attention_layernorm is not None:  # "layer"
            return h + self.mlp(self.post_attention_layernorm(h))
        mid = self.layers[0](h)
        if self.kind == "mlp":
            mid = torch.nn.functional.silu(mid)
        return h + self.layers[1](mid)


class ExitHead(nn.Module):
    def __init__(self, dim: int, eps: float, adapter: str, rank: int, classifier: bool) -> None:
        super().__init__()
        self.adapter = Adapter(adapter, dim, rank, eps)
        self.norm = RMSNorm(dim, eps)
        self.classifier = nn.Linear(dim, 1) if classifier else None


class ExitHeads(nn.Module):
    def __init__(self, cfg: ExitConfig, dim: int, eps: float) -> None:
        super().__init__()
        deepest = max_exit_layer(cfg.adapter, cfg.num_layers)
        bad = [x for x in cfg.exit_layers if not 1 <= x <= deepest]
        if bad:
            why = " (the head of exit l is decoder layer l + 1)" if cfg.adapter == "layer" else ""
            raise ValueError(
                f"exit layers {bad} out of range: {cfg.adapter!r} heads of a "
                f"{cfg.num_layers}-layer model need exit layers in [1, {deepest}]{why}"
            )
        self.config = cfg
        self.heads = nn.ModuleDict(
            {
                str(layer): ExitHead(dim, eps, cfg.adapter, cfg.adapter_rank, cfg.classifier)
                for layer in cfg.exit_layers
            }
        )

    def head(self, layer: int) -> ExitHead:
        return self.heads[str(layer)]  # type: ignore[return-value]

    @property
    def layer_heads(self) -> bool:
        """Heads that read h_mid of layer l + 1 instead of h_l (see the module docstring)."""
        return self.config.adapter == "layer"

    def normed(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """[n, D] head input (h_l; h_mid of layer l + 1 for ``layer`` heads) -> [n, D] input of
        the LM head."""
        head = self.head(layer)
        return head.norm(head.adapter(h))  # type: ignore[no-any-return]

    def probe(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Classifier logit [n] of "this exit's argmax equals the final one"."""
        clf = self.head(layer).classifier
        if clf is None:
            raise ValueError("this sidecar has no classifier probes")
        return clf(h.to(clf.weight.dtype)).squeeze(-1)  # type: ignore[no-any-return]


def load_sidecar(folder: Path) -> tuple[ExitConfig, dict[str, torch.Tensor]] | None:
    cfg_path = folder / CONFIG_NAME
    if not cfg_path.exists():
        return None
    raw = json.loads(cfg_path.read_text())
    fmt = raw.pop("format", FORMATS[0])
    if fmt not in FORMATS:
        raise ValueError(f"{cfg_path}: unsupported exit sidecar format {fmt!r}, want {FORMATS}")
    cfg = ExitConfig(**raw)
    weights: dict[str, torch.Tensor] = {}
    if (folder / WEIGHTS_NAME).exists():
        from safetensors.torch import load_file

        weights = load_file(str(folder / WEIGHTS_NAME))
    return cfg, weights


def save_sidecar(
    folder: Path, cfg: ExitConfig, heads: ExitHeads | None, delta: BaseDelta | None = None
) -> None:
    """Write the sidecar; with ``delta`` also its file, recorded in ``cfg.base_delta`` (which must
    already hold the ``base_model_hash``)."""
    folder.mkdir(parents=True, exist_ok=True)
    if delta is not None:
        if not cfg.base_delta or "base_model_hash" not in cfg.base_delta:
            raise ValueError("cfg.base_delta must name the base_model_hash the delta belongs to")
        cfg.base_delta = {**cfg.base_delta, "rank": delta.rank, "scale": delta.scale}
        cfg.base_delta["file"] = DELTA_NAME
        save_base_delta(folder / DELTA_NAME, delta)
    (folder / CONFIG_NAME).write_text(config_json(cfg))
    if heads is not None:
        from safetensors.torch import save_file

        state = {k: v.detach().float().contiguous() for k, v in heads.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_NAME))


def config_json(cfg: ExitConfig) -> str:
    """``exit_config.json``'s text: indented, with the (long) shortlist on one line."""
    d = {"format": FORMAT, **asdict(cfg)}
    shortlist = d.pop("shortlist")
    text = json.dumps({**d, "shortlist": "@"}, indent=2)
    return text.replace('"shortlist": "@"', f'"shortlist": {json.dumps(shortlist)}')


def build_exit_heads(
    cfg: ExitConfig, weights: dict[str, torch.Tensor], dim: int, eps: float
) -> ExitHeads | None:
    """Modules for a ``tuned`` or classifier-carrying sidecar; None for plain shared heads."""
    if cfg.head == "shared" and not cfg.classifier:
        return None
    heads = ExitHeads(cfg, dim, eps)
    if weights:
        missing, unexpected = heads.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"exit sidecar weights mismatch: missing {missing}, unexpected {unexpected}"
            )
    return heads


def load_exit_setup(
    folders: list[Path],
    num_layers: int,
    dim: int,
    eps: float,
    model: LlamaForCausalLM | None = None,
    base: Path | None = None,
) -> tuple[ExitConfig, ExitHeads | None]:
    """The first sidecar found in ``folders`` (model folder first), else shared-head exits.

    A sidecar with a base delta is merged into ``model`` (loaded from ``base``, unpacked) here,
    after checking that ``base`` holds the weights it was trained from."""
    for folder in folders:
        found = load_sidecar(folder)
        if found is not None:
            cfg, weights = found
            if cfg.num_layers != num_layers:
                raise ValueError(
                    f"{folder}: exit sidecar is for {cfg.num_layers} layers, model has {num_layers}"
                )
            if cfg.base_delta:
                if model is None or base is None:
                    raise ValueError(f"{folder}: a sidecar with a base delta needs the model")
                apply_sidecar_delta(model, cfg, folder, base)
            return cfg, build_exit_heads(cfg, weights, dim, eps)
    return ExitConfig(num_layers, default_shared_exit_layers(num_layers)), None
