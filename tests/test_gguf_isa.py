"""The GGUF block kernels' other instruction-set paths, on this machine.

``native.py`` builds the kernels for the CPU at hand (``-march=native``), so on an AVX-512
machine the AVX2 and portable paths of ``csrc/gguf_blocks.h`` / ``csrc/gguf_ops.cpp`` would never
run. Here ``gguf_ops.cpp`` alone is built twice more, for x86-64-v3 (AVX2, FMA, F16C: the AVX2
path) and plain x86-64 (the portable loop), each in a fresh process (the op names are the same),
and each must de-quantize bit for bit as ``gguf.quants`` does and multiply within float
tolerance of F.linear, at 1 and 3 threads.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CSRC = Path(__file__).resolve().parent.parent / "eeserve" / "kernels" / "csrc"

CHECK = """
import sys
import numpy as np, torch, torch.nn.functional as F
from torch.utils.cpp_extension import load
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
load(name="gguf_isa_" + sys.argv[2].replace("-", "_"), sources=[sys.argv[1]],
     extra_cflags=["-O3", "-march=" + sys.argv[2], "-ffast-math", "-fopenmp"],
     extra_ldflags=["-fopenmp"], build_directory=sys.argv[3], is_python_module=False)
ops = torch.ops.eeserve
geometry = {T.Q4_0: (32, 18, (0,)), T.Q4_1: (32, 20, (0, 2)), T.Q5_0: (32, 22, (0,)),
            T.Q5_1: (32, 24, (0, 2)), T.Q8_0: (32, 34, (0,)), T.Q4_K: (256, 144, (0, 2)),
            T.Q6_K: (256, 210, (208,))}
rng = np.random.default_rng(0)
n, k = 45, 512
for kind, (qk, size, scales) in geometry.items():
    blocks = rng.integers(0, 256, size=(n * k // qk, size), dtype=np.uint8)
    for off in scales:
        half = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, off : off + 2] = half.view(np.uint8).reshape(-1, 2)
    blocks = blocks.reshape(n, -1)
    ref = torch.from_numpy(dequantize(blocks, kind))
    got = ops.gguf_dequantize(torch.from_numpy(blocks), int(kind), k)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), kind.name
    for threads in (1, 3):
        torch.set_num_threads(threads)
        for m in (1, 3, 8, 13):
            x = torch.randn(m, k)
            out = torch.empty(m, n)
            ops.gguf_linear(x, torch.from_numpy(blocks), int(kind), out)
            exact = F.linear(x.double(), ref.double())
            bound = F.linear(x.double().abs(), ref.double().abs()) * k * 2.0**-24
            assert bool(((out.double() - exact).abs() <= bound).all()), (kind.name, m)
print("ok")
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction sets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_other_instruction_set_paths(march: str, tmp_path: Path) -> None:
    # torch's extension builder runs ``ninja`` from PATH: the virtual environment's bin folder.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(CSRC / "gguf_ops.cpp"), march, str(tmp_path)],
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
