"""benchmarks/analyse_e2e_trace.py on a hand-made trace: which kernels belong to a forward
(through the launch's correlation id), their union over streams, and the host time of
the annotated calls and of the CUDA runtime calls inside them."""

from __future__ import annotations

import gzip
import json

from benchmarks import analyse_e2e_trace as m


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_union_and_attribution(tmp_path):
    assert m.union([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    ev = [
        _x("user_annotation", "e2e.forward", 100, 100),
        _x("user_annotation", "kv.write", 110, 30),
        _x("cuda_runtime", "cudaLaunchKernel", 115, 5, correlation=1),
        _x("user_annotation", "kv.decode_rows", 150, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 155, 4, correlation=2),
        _x("cuda_runtime", "cudaStreamWaitEvent", 160, 2, correlation=3),
        _x("kernel", "k1", 300, 50, correlation=1),
        _x("kernel", "k2", 320, 50, correlation=2),  # overlaps k1 on another stream
        # a second forward that also prefilled
        _x("user_annotation", "e2e.forward", 1000, 50),
        _x("user_annotation", "kv.prefill_workspace", 1010, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 1012, 3, correlation=9),
        _x("kernel", "k9", 1100, 7, correlation=9),
        _x("kernel", "stray", 5000, 7, correlation=77),  # launched outside any forward
    ]
    steps = m.analyse(ev)
    assert len(steps) == 2
    a, b = steps
    assert a["host_us"] == 100 and a["kernels"] == 2
    assert a["gpu_busy_us"] == 70 and a["gpu_span_us"] == 70
    assert a["calls_us"] == {"kv.write": 30, "kv.decode_rows": 20}
    assert a["runtime_us"] == {"kv.write / cudaLaunchKernel": 5,
                               "kv.decode_rows / cudaLaunchKernel": 4,
                               "kv.decode_rows / cudaStreamWaitEvent": 2}
    assert not a["prefill"]
    assert b["prefill"] and b["gpu_busy_us"] == 7
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    out = tmp_path / "steps.json"
    assert m.main([str(path), "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())[str(path)]) == 2
