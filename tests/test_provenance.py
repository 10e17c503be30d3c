"""What a result file says of its machine: the CPU model, its instruction sets and the engine's
kernel path (``tuning.provenance``)."""

from __future__ import annotations

from eeserve.kernels.native import load as load_native
from eeserve.tuning.provenance import (
    ISA_FLAGS,
    KernelPath,
    cpu_model_and_isa,
    kernel_path,
    machine_description,
    provenance,
)


def test_the_kernel_path_follows_the_isa_the_kernels_are_compiled_for() -> None:
    zen4 = ["avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16"]
    assert kernel_path(zen4, built=True) is KernelPath.AVX512
    assert kernel_path(["avx2", "fma", "f16c"], built=True) is KernelPath.AVX2
    # csrc's AVX2 loops need FMA and F16C beside AVX2; without them the portable loop runs
    assert kernel_path(["avx2"], built=True) is KernelPath.PORTABLE
    assert kernel_path([], built=True) is KernelPath.PORTABLE
    assert kernel_path(zen4, built=False) is KernelPath.PYTORCH


def test_every_machine_record_names_the_cpu_its_isa_and_the_kernel_path_that_ran() -> None:
    machine = provenance()["machine"]
    assert machine == machine_description()
    cpu, isa = cpu_model_and_isa()
    assert (machine["cpu_model"], machine["isa"]) == (cpu, isa)
    assert set(isa) <= set(ISA_FLAGS)
    assert machine["kernel_path"] == kernel_path(isa, load_native() is not None).value
    assert machine["kernel_path"] in {p.value for p in KernelPath}
