"""Base delta of a model trained to exit: low-rank corrections of the base projections.

Contract: a ``BaseDelta`` holds, per decoder layer and per HF projection (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``), a pair ``A`` [r, in] and
``B`` [out, r]; the corrected weight is ``W + scale * B @ A``. It is stored in the exit sidecar as
``base_delta.safetensors`` (float16, keys ``model.layers.{i}.{self_attn|mlp}.{proj}.lora_A`` /
``.lora_B``) and described in ``exit_config.json`` (``ExitConfig.base_delta``: rank, scale, file
and ``base_model_hash``, the ``weights_hash`` of the base it was trained from).
``merge_base_delta`` adds it into a loaded (unpacked) model in place, on the rows of the fused
``qkv_proj`` / ``gate_up_proj`` that the HF projection occupies; ``apply_sidecar_delta`` does the
same for a sidecar after checking the base's hash (a ValueError names both hashes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eeserve.models.config import ModelConfig
from eeserve.models.exit_config import ExitConfig
from eeserve.models.llama import LlamaForCausalLM

DELTA_NAME = "base_delta.safetensors"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NON_BASE_FILES = ("exit_heads.safetensors", DELTA_NAME)  # sidecar files beside the weights


@dataclass(frozen=True)
class ProjectionSlot:
    """Where an HF projection lives in the fused model: module path and output rows."""

    module: str  # within a decoder layer, e.g. "self_attn.qkv_proj"
    start: int  # first output row of the fused weight
    rows: int  # out features
    cols: int  # in features


@dataclass
class BaseDelta:
    rank: int
    scale: float
    tensors: dict[str, torch.Tensor]  # "model.layers.{i}.{group}.{proj}.lora_A|lora_B"


def projection_slots(cfg: ModelConfig) -> dict[str, ProjectionSlot]:
    """HF projection name -> its slot in ``models.llama`` (q/k/v and gate/up are fused)."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": ProjectionSlot("self_attn.qkv_proj", 0, q, d),
        "k_proj": ProjectionSlot("self_attn.qkv_proj", q, kv, d),
        "v_proj": ProjectionSlot("self_attn.qkv_proj", q + kv, kv, d),
        "o_proj": ProjectionSlot("self_attn.o_proj", 0, d, q),
        "gate_proj": ProjectionSlot("mlp.gate_up_proj", 0, i, d),
        "up_proj": ProjectionSlot("mlp.gate_up_proj", i, i, d),
        "down_proj": ProjectionSlot("mlp.down_proj", 0, d, i),
    }


def delta_key(layer: int, proj: str) -> str:
    """Key prefix of one projection's A/B (HF naming: the stored delta never says "qkv")."""
    group = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{group}.{proj}"


def weights_hash(folder: Path) -> str:
    """sha256 over the base weights' tensors (names, dtypes, shapes, bytes; file layout and
    metadata ignored), the sidecar files in ``folder`` excluded."""
    digest = hashlib.sha256()
    files = [f for f in sorted(folder.glob("*.safetensors")) if f.name not in NON_BASE_FILES]
    if not files:
        raise ValueError(f"{folder} has no .safetensors weights to hash")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sorted(sf.keys()):
                t = sf.get_tensor(name).contiguous()
                digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
                digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def save_base_delta(path: Path, delta: BaseDelta) -> None:
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in delta.tensors.items()}
    save_file(state, str(path))


def load_base_delta(path: Path, rank: int, scale: float) -> BaseDelta:
    if not path.exists():
        raise ValueError(f"exit sidecar names a base delta {path} that does not exist")
    return BaseDelta(rank, scale, load_file(str(path)))


def rounded(delta: BaseDelta) -> BaseDelta:
    """The delta as stored (float16): what a model loading the sidecar will merge."""
    tensors = {k: v.detach().to(torch.float16).float() for k, v in delta.tensors.items()}
    return BaseDelta(delta.rank, delta.scale, tensors)


@torch.no_grad()
def merge_base_delta(model: LlamaForCausalLM, delta: BaseDelta) -> None:
    """W[rows] += scale * B @ A for every stored projection (in float32 or the model's dtype if
    wider, then rounded to the model's dtype).

    The model must be unpacked (``load_model``), i.e. merged before the runner packs it."""
    slots = projection_slots(model.config)
    expected = {
        f"{delta_key(i, p)}.lora_{ab}"
        for i in range(model.config.num_layers)
        for p in PROJECTIONS
        for ab in "AB"
    }
    if set(delta.tensors) != expected:
        odd = sorted(set(delta.tensors) ^ expected)[:4]
        raise ValueError(f"base delta tensors do not match this model's projections: {odd}")
    for i, layer in enumerate(model.layers):
        for proj, slot in slots.items():
            a = delta.tensors[f"{delta_key(i, proj)}.lora_A"]  # [r, in]
            b = delta.tensors[f"{delta_key(i, proj)}.lora_B"]  # [out, r]
            if a.shape != (delta.rank, slot.cols) or b.shape != (slot.rows, delta.rank):
                raise ValueError(
                    f"base delta {delta_key(i, proj)}: A {tuple(a.shape)}, B {tuple(b.shape)} "
                    f"do not fit rank {delta.rank} and weight [{slot.rows}, {slot.cols}]"
                )
            weight = layer.get_submodule(slot.module).weight
            if not isinstance(weight, torch.Tensor):
                raise ValueError("a base delta is merged into an unpacked model (load_model)")
            rows = weight.narrow(0, slot.start, slot.rows)
            wide = torch.promote_types(rows.dtype, torch.float32)
            ba = b.to(rows.device, wide) @ a.to(rows.device, wide)
            rows.copy_((rows.to(wide) + delta.scale * ba).to(rows.dtype))


def apply_sidecar_delta(
    model: LlamaForCausalLM, cfg: ExitConfig, sidecar: Path, base: Path
) -> None:
    """Merge the sidecar's base delta (if it has one) into ``model``, loaded from ``base``."""
    spec = cfg.base_delta
    if not spec:
        return
    want, have = str(spec["base_model_hash"]), weights_hash(base)
    if want != have:
        raise ValueError(
            f"{sidecar}: its base delta was trained on base weights {want}, but {base} has "
            f"weights {have}: it belongs to another model"
        )
    delta = load_base_delta(sidecar / str(spec["file"]), int(spec["rank"]), float(spec["scale"]))
    merge_base_delta(model, delta)
