"""The Triton resolve kernel against the reference on random traces (hypothesis).

hypothesis is the [test] extra; without it this module is skipped, test_kernels_resolve.py
(whose helpers, ``resolve_common``, the GPU tests import too) runs.
"""

import random

import pytest

pytest.importorskip("hypothesis")

from hypothesis import given, settings, strategies as st  # noqa: E402

from resolve_common import run_trace, small_cfg  # noqa: E402


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), q=st.sampled_from([1, 2, 4]), K=st.integers(1, 6),
       extra=st.integers(0, 5), B=st.integers(1, 5), compact=st.booleans())
def test_random_traces(seed, q, K, extra, B, compact):
    S = q * K + extra
    cfg = small_cfg(K=K, q=q, S=S, B=B, L=1, R=4)
    rng = random.Random(seed)
    ids = rng.sample(range(1, 16), 3)
    seqs = {i: rng.choice([0, 1, S - 1 if S > 1 else 1, S, S + 1, rng.randrange(1, 60)]) for i in ids}
    run_trace(cfg, seqs, steps=3, seed=seed, compact=compact, holes=rng.choice([0.0, 0.5]))
