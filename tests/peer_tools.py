"""Stand-ins for llama.cpp's tools, shared by the peer section's tests."""

# A stand-in llama-batched-bench: one row per run, 50 tok/s.
FAKE_BATCHED_BENCH = """#!/bin/sh
prev=""
for a in "$@"; do
  case "$prev" in -npp) pp=$a;; -ntg) tg=$a;; -npl) pl=$a;; esac
  prev=$a
done
printf '{"pp": %s, "tg": %s, "pl": %s, ' "$pp" "$tg" "$pl"
echo '"t_pp": 0.1, "t_tg": 1.0, "speed_tg": 50.0}'
"""
