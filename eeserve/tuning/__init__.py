"""Making exits worth taking: exit-head training (``eeserve tune-exits``), threshold calibration
(``eeserve calibrate``, Learn-then-Test), the quality measures and the offline prompt splits.

Contract: sits above the public API (it drives ``LLM``/``LLMEngine`` to collect data and to
measure); below the benchmarks and the CLI.
"""
