"""Row formats, randomized: any finite values through the fp8_ds_mla kernels (hypothesis).

hypothesis is the [test] extra; without it this module is skipped, test_formats.py runs.
"""

import pytest
import torch

pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hisparse import formats as F  # noqa: E402

from test_formats import quant  # noqa: E402

_finite_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=25, deadline=None)
@given(vals=st.lists(_finite_f32, min_size=1, max_size=64), scale_exp=st.integers(-140, 120),
       bf16_in=st.booleans())
def test_property_triton_equals_reference_and_round_trip_bound(vals, scale_exp, bf16_in):
    """Any finite values (subnormal to near float32 max, -0.0) in any tile position:
    Triton bytes == reference bytes, scales are powers of two >= 2^-13, and the round
    trip is within half an e4m3 ulp."""
    n = len(vals)
    x = torch.zeros(2, 576)
    pos = torch.arange(n) * 17 % 576  # spread over all tiles and the RoPE part
    x[0, pos] = torch.tensor(vals, dtype=torch.float32)
    x[1] = torch.clamp(x[0] * 2.0**scale_exp, -3e38, 3e38)
    x = x.to(torch.bfloat16) if bf16_in else x
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))  # bf16 rounding may overflow
    ref = F.quantize_fp8_ds_mla_reference(x)
    assert torch.equal(quant(x, True), ref)
    scales = ref[:, 512:528].contiguous().view(torch.float32)
    assert (scales >= 2.0**-13).all() and torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    back = F.dequantize_fp8_ds_mla_reference(ref, out_dtype=torch.float32)
    lat = x[:, :512].float().reshape(2, 4, 128)
    err = (back[:, :512].reshape(2, 4, 128) - lat).abs()
    assert (err <= torch.maximum(lat.abs() * 2.0**-4, scales[:, :, None] * 2.0**-10)).all()
