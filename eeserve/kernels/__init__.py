"""CPU fast paths: the engine's own kernels (``csrc/``, built by ``native``) and weight packing.

Contract: ``native.load()`` builds or loads the kernels once per machine (``None`` without a
compiler); ``packing`` swaps a loaded model's projections and norms for the fast versions. May
import ``models`` and the top-level data types; knows nothing of the engine.
"""
