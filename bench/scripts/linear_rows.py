"""The float32 linear kernel's time per row against the row count: the four projection shapes of
the default model (576x960 qkv, 576x576 o, 576x3072 gate/up, 1536x576 down) x 30 layers, random
weights, best of 5. Usage: linear_rows.py"""

import time

import torch

from eeserve.kernels.native import load
from eeserve.kernels.packing import pack_blocks

torch.set_num_threads(2)
ops = load()
shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
layers = [[(pack_blocks(torch.randn(n, k)), k, n) for k, n in shapes] for _ in range(30)]
Ms = (8, 40, 64, 80, 104, 112, 128, 256, 512, 1336)
best = {M: 1e9 for M in Ms}
xs = {M: [torch.randn(M, k) for k, _ in shapes] for M in Ms}
for _rnd in range(5):
    for M in Ms:
        t = time.perf_counter()
        for ws in layers:
            for (w, _k, n), x in zip(ws, xs[M]):
                ops.f32_linear(x, w, None, n)
        best[M] = min(best[M], time.perf_counter() - t)
flop = 2 * sum(k * n for k, n in shapes) * 30
for M in Ms:
    print(
        f"M {M:5d}: {best[M] * 1e3:7.1f} ms, {best[M] * 1e3 / M:6.3f} ms/row, "
        f"{flop * M / best[M] / 1e9:6.1f} GFLOPS"
    )
