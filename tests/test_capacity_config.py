"""A hot buffer too small for one decode step is a capacity failure found at
configuration (ARCHITECTURE: "hot buffer too small for q x top-k"; ``hisparse.errors``):
``HiSparseConfig`` raises ``CapacityError`` (not ``ValueError``) when
device_buffer_size < max_query_len x top_k, before anything is allocated, and the CLI
reports it as a capacity failure (exit 3), as README's exit-code table says.
"""

import pytest

from hisparse import CapacityError, HiSparseConfig
from hisparse_tools.cli import main
from hisparse_tools.exit_codes import EXIT_CAPACITY, classify

K = 8


@pytest.mark.parametrize("q", [1, 2, 3])
def test_buffer_smaller_than_one_step_is_a_capacity_error(q):
    base = dict(num_layers=1, host_pool_tokens=64, top_k=K, max_query_len=q, device="cpu")
    assert HiSparseConfig(**base, device_buffer_size=q * K).device_buffer_size == q * K
    with pytest.raises(CapacityError, match=rf"max_query_len x top_k = {q} x {K} = {q * K}") as e:
        HiSparseConfig(**base, device_buffer_size=q * K - 1)
    assert not isinstance(e.value, ValueError)  # one kind of failure, one exception
    assert f"device_buffer_size >= {q * K}" in str(e.value)  # what to configure instead


def test_other_bad_sizes_stay_value_errors():
    """Inconsistent or out-of-range fields other than the buffer are caller mistakes."""
    base = dict(num_layers=1, host_pool_tokens=64, top_k=K, device="cpu")
    with pytest.raises(ValueError):
        HiSparseConfig(**base, device_buffer_size=0)
    with pytest.raises(ValueError):
        HiSparseConfig(**{**base, "host_pool_tokens": 8}, host_block_size=16)


def test_the_cli_exit_code_is_capacity(capsys):
    e = CapacityError("device_buffer_size=4 is smaller than max_query_len x top_k")
    assert classify(e) == (EXIT_CAPACITY, "capacity")
    rc = main(["stress", "--requests", "2", "--context", "200", "--layers", "1", "--top-k",
               str(K), "--buffer", str(K - 1), "--steps", "2", "--block-size", "16",
               "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == EXIT_CAPACITY == 3, err
    assert len(err.splitlines()) == 1 and "capacity" in err and "Traceback" not in err, err
