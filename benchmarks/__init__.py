"""hisparse's GPU benchmarks, profilers and H200 run helpers.

Each module runs from the repository root as ``python -m benchmarks.NAME`` (``--help``
lists its arguments); ``bash benchmarks/gpu_run.sh [SECTION ...]`` runs them on the
H200 test machine. ``benchmarks.common`` holds what they share: timing statistics,
CUDA-event timing, the environment record and JSON output. The current figures and
the commands that produced them are in BENCHMARKS.md; ``benchmarks/results/current/``
keeps the result files it quotes (earlier ones are in git).

This package imports nothing itself: a benchmark decides when torch and triton load
(``--dry-run`` runs set ``TRITON_INTERPRET`` first).
"""
