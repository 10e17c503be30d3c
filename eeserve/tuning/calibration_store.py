"""Where a calibration is stored: the exit sidecar's ``exit_config.json``.

Contract: ``with_calibration`` puts a calibration entry first in an ``ExitConfig`` (replacing an
entry with the same measure, delta, epsilon, policy, loss and workload), sets its measure's
threshold and, unless told to keep the sidecar's default, makes it the default measure, enabled
by default; an entry calibrated on a constrained workload (``structured``) sets the measure's
constrained threshold only;
``target_folder`` says which sidecar a model's calibration goes to (``--out-config``, else the
packaged sidecar of the default models, else the model folder); ``write_calibration``
merges an entry into that sidecar, copying the heads (and a trained model's base delta) from
the sidecar the engine loaded when the target holds none yet.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from eeserve.models.base_delta import DELTA_NAME
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import CONFIG_NAME, WEIGHTS_NAME, load_sidecar, save_sidecar
from eeserve.models.loader import DEFAULT_MODEL, VARIANT_MODEL, packaged_sidecar, resolve_model


def with_calibration(
    cfg: ExitConfig, entry: dict[str, object], make_default: bool = True
) -> ExitConfig:
    """A copy of ``cfg`` with ``entry`` first in ``calibration`` and its measure's threshold
    set; ``make_default``: that measure becomes the default, enabled by default."""
    key = ("measure", "delta", "epsilon", "policy", "loss", "structured")
    kept = [c for c in cfg.calibration if any(c.get(k) != entry.get(k) for k in key)]
    measure = str(entry["measure"])
    value = float(entry["threshold"])  # type: ignore[arg-type]
    if entry.get("structured"):  # a constrained workload: the threshold of constrained requests
        constrained = {**cfg.constrained_thresholds, measure: value}
        return dataclasses.replace(
            cfg, calibration=[entry, *kept], constrained_thresholds=constrained
        )
    thresholds = {**cfg.thresholds, measure: value}
    calibrated = dataclasses.replace(cfg, calibration=[entry, *kept], thresholds=thresholds)
    if not make_default:
        return calibrated
    return dataclasses.replace(calibrated, default_measure=measure, enabled_by_default=True)


def sidecar_source(model: str) -> Path | None:
    """The folder whose sidecar the engine loaded for ``model`` (same search as the engine)."""
    for folder in [resolve_model(model), packaged_sidecar(model)]:
        if folder is not None and (folder / CONFIG_NAME).exists():
            return folder
    return None


def target_folder(model: str, out_config: str | None) -> Path:
    if out_config:
        return Path(out_config)
    if model in (DEFAULT_MODEL, VARIANT_MODEL):  # the variant's weights folder is the original's
        packaged = packaged_sidecar(model)
        if packaged is None:
            raise ValueError(
                "the default model has no packaged exit sidecar (eeserve/data/smollm2) to write "
                "the calibration into; pass --out-config DIR"
            )
        return packaged
    return resolve_model(model)


_STRUCTURE = ("num_layers", "exit_layers", "head", "adapter", "adapter_rank", "classifier")


def write_calibration(
    model: str,
    out: Path,
    calibrated: ExitConfig,
    entry: dict[str, object],
    make_default: bool = True,
) -> Path:
    """Merge ``entry`` into the sidecar at ``out`` (created from ``calibrated`` if absent);
    ``make_default`` as ``with_calibration``."""
    found = load_sidecar(out)
    if found is not None:
        base = found[0]
        differs = [f for f in _STRUCTURE if getattr(base, f) != getattr(calibrated, f)]
        if differs:
            raise ValueError(
                f"{out / CONFIG_NAME} describes other exits than calibrated: {differs}"
            )
    else:
        base = calibrated
        source = sidecar_source(model)
        for name in (WEIGHTS_NAME, DELTA_NAME):  # the heads, and a trained model's base delta
            if source is not None and (source / name).exists():
                out.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source / name, out / name)
    save_sidecar(out, with_calibration(base, entry, make_default), None)
    return out / CONFIG_NAME
