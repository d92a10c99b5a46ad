"""hisparse's tools: the ``hisparse`` command and what it runs, apart from the library.

- ``cli``: the command (``hisparse``, or ``python -m hisparse_tools``).
- ``stress`` (+ ``stress_limits``, ``stress_pool``, ``stress_prefetch``, ``stress_prefix``,
  ``stress_report``): the real cache
  under a long-context workload, verified byte-exact.
- ``whatif`` (+ ``whatif_report``), ``belady``, ``sources``, ``traces``: miss rates
  simulated from a recorded or generated trace; no cache, no kernel.
- ``workload``: ``StressOptions`` and the join/leave ``Schedule`` that stress and whatif
  share, and ``RampSchedule``, stress's load ramp against a device pool (``--ramp``).
- ``plan``, ``sizing``, ``capacity``, ``autotune``: how many requests fit, and the fastest
  batch.
- ``mini_engine``: a random-weight sparse-MLA engine served with and without hisparse.
- ``env``, ``preflight``, ``outputs``, ``flag_rules``, ``exit_codes``, ``progress``,
  ``report``, ``units``: the command's shared pieces (``units``: byte and token counts).

The library never imports this package; the tools use only the names the library
exports (its public modules' ``__all__``). tests/test_layers.py checks both.
"""
