"""``overlap="auto"`` on the GPU: the auto layer times both modes with CUDA events (no
host sync), keeps the serial twin's cache state bit for bit and its outputs within the
split merge's rounding, eagerly and with ``graphs=True`` (a graph per mode); a call
captured by an engine runs the mode chosen so far and is not timed."""

from __future__ import annotations

import random

import pytest
import torch

from hisparse.attention.triton_backend import TritonBackend
from hisparse.decode import DecodeLayer
from hisparse.decode.auto import MIN_SAMPLES

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs CUDA", allow_module_level=True)

from test_decode_graphs_gpu import _state_equal  # noqa: E402
from test_overlap_gpu import B, DEV, I32, SM, make, topk  # noqa: E402


@pytest.mark.parametrize("graphs", [False, True])
def test_auto_layer_times_both_modes_and_matches_serial(graphs):
    a, b = make(), make()
    auto = DecodeLayer(a, TritonBackend(validate=False), overlap="auto", graphs=graphs)
    serial = DecodeLayer(b, TritonBackend(validate=False), overlap="serial")
    ids = torch.arange(B, dtype=I32, device=DEV)
    rng = random.Random(5)
    g = torch.Generator(device="cpu").manual_seed(6)
    q = torch.empty((B, 128, 576), dtype=torch.bfloat16, device=DEV)
    tk = torch.empty((B, 256), dtype=I32, device=DEV)
    for step in range(12 * MIN_SAMPLES):
        q.copy_((torch.randn((B, 128, 576), generator=g) * 0.3).to(DEV, torch.bfloat16))
        tk.copy_(topk(rng, 0.5 + 0.1 * (step % 5)))
        want, want_lse = serial(0, ids, tk, q, sm_scale=SM)
        out, lse = auto(0, ids, tk, q, sm_scale=SM)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
        _state_equal(a, b, step)
    torch.cuda.synchronize()
    rep = auto.auto_report()[f"0/{B}"]
    assert rep["runs"]["split"] >= MIN_SAMPLES and rep["runs"]["serial"] >= MIN_SAMPLES, rep
    assert all(v is not None and v > 0 for v in rep["cost_us"].values()), rep
    assert rep["chosen"] in ("serial", "split")
    if graphs:
        assert auto.graphs.report()["graphs"] >= 2  # one per mode


def test_a_captured_auto_call_keeps_the_mode_chosen_so_far():
    a, b = make(), make()
    auto = DecodeLayer(a, TritonBackend(validate=False), overlap="auto")
    ids = torch.arange(B, dtype=I32, device=DEV)
    rng = random.Random(7)
    tk = topk(rng, 0.9)
    q = (torch.randn((B, 128, 576)) * 0.3).to(DEV, torch.bfloat16)
    for _ in range(2 * MIN_SAMPLES):
        auto(1, ids, tk, q, sm_scale=SM)
    torch.cuda.synchronize()
    before = auto.auto_report()
    chosen = auto.chooser.mode_now(1, B)
    twin = DecodeLayer(b, TritonBackend(validate=False), overlap=chosen)
    for _ in range(2 * MIN_SAMPLES):  # the twin's state follows
        twin(1, ids, tk, q, sm_scale=SM)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = auto(1, ids, tk, q, sm_scale=SM)
    assert auto.auto_report() == before
    graph.replay()
    want, _ = twin(1, ids, tk, q, sm_scale=SM)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
