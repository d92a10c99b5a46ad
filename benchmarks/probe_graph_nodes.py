"""What one node costs inside a CUDA graph, and what a page-lock release does to a capture.

``nodes`` (default): a chain of ``--chain`` small kernels (``x.add_(1)``) captured in a
graph, with one extra node every 100 or 10 kernels, of each kind a decode step's graph
holds: a Triton kernel, the host mirror's kernel writing pinned host rows over UVA, one
reading them, a small kernel on a forked (and rejoined) stream, the same on a
high-priority stream, the mirror kernel on a forked stream, a device-to-host memcpy,
a memset. Replay GPU time (CUDA events, median of ``--reps``), two rounds interleaved,
and the cost per extra node against the plain chain of the same round.

``unpin``: ``cudaHostUnregister`` of a registered range inside a capture, then one
kernel and the capture's end: whether the capture survives (against the same capture
without the unregister). The reason ``hisparse.device`` defers such releases.

  python -m benchmarks.probe_graph_nodes [nodes|unpin] [--chain 400] [--reps 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys

import numpy as np
import torch

from benchmarks import common

KINDS = ("triton_d2d", "uva_write", "uva_read", "fork_kernel", "fork_hiprio", "fork_uva_write", "memcpy_d2h", "memset")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("probe", nargs="?", choices=("nodes", "unpin"), default="nodes")
    ap.add_argument("--chain", type=common.positive_int, default=400, help="kernels in the chain [400]")
    ap.add_argument("--reps", type=common.positive_int, default=30, help="timed replays per graph [30]")
    ap.add_argument("--out", default=None, help="JSON results")
    return ap.parse_args(argv)


class Nodes:
    """The chain's tensors and the extra node of each kind."""

    def __init__(self, dev: torch.device) -> None:
        from hisparse.device import PinnedBuffer
        self.dev = dev
        self.x = torch.zeros(1 << 14, device=dev)  # float32 [16K]: the chain's operand
        self.rows = torch.randint(0, 255, (64, 656), dtype=torch.uint8, device=dev)  # uint8 [64, 656]
        self.pinned = PinnedBuffer(4096 * 656)
        self.host = self.pinned.tensor.view(4096, 656)  # uint8 [4096, 656], page-locked
        self.src = torch.arange(13, dtype=torch.int32, device=dev)  # int32 [13] row lists
        self.dst = torch.arange(100, 113, dtype=torch.int32, device=dev)
        self.dst_dev = self.dst - 50
        self.small = torch.zeros(13 * 656, dtype=torch.uint8).pin_memory()  # uint8 [13 * 656]
        self.side = torch.cuda.Stream(dev)
        self.side_hi = torch.cuda.Stream(dev, priority=-1)

    def _forked(self, stream, fn) -> None:
        cur = torch.cuda.current_stream(self.dev)
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            fn()
        cur.wait_stream(stream)

    def extra(self, kind: str) -> None:
        from hisparse.cache import copy_rows_unchecked
        d = self.dev
        if kind == "triton_d2d":
            copy_rows_unchecked(self.rows, self.src, self.rows, self.dst_dev, d)
        elif kind == "uva_write":
            copy_rows_unchecked(self.rows, self.src, self.host, self.dst, d)
        elif kind == "uva_read":
            copy_rows_unchecked(self.host, self.dst, self.rows, self.src, d)
        elif kind == "fork_kernel":
            self._forked(self.side, lambda: self.rows[0].add_(1))
        elif kind == "fork_hiprio":
            self._forked(self.side_hi, lambda: self.rows[0].add_(1))
        elif kind == "fork_uva_write":
            self._forked(self.side, lambda: copy_rows_unchecked(self.rows, self.src, self.host, self.dst, d))
        elif kind == "memcpy_d2h":
            self.small.copy_(self.rows[:13].reshape(-1), non_blocking=True)
        elif kind == "memset":
            self.rows[1].zero_()
        elif kind != "none":
            raise ValueError(kind)

    def graph(self, kind: str, every: int, chain: int) -> torch.cuda.CUDAGraph:
        s = torch.cuda.Stream(self.dev)
        s.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(s):  # every kernel loaded before the capture
            self.x.add_(1)
            self.extra(kind)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(chain):
                self.x.add_(1)
                if every and i % every == every - 1:
                    self.extra(kind)
        return g


def replay_us(g: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median us of one replay (CUDA events, synchronised between samples)."""
    return statistics.median(common.time_calls(g.replay, reps=reps, warmup=3, cuda=True))


def probe_nodes(a: argparse.Namespace, report: dict) -> None:
    n = Nodes(torch.device("cuda", torch.cuda.current_device()))
    rounds = []
    for _ in range(2):
        got = {"none/0": replay_us(n.graph("none", 0, a.chain), a.reps)}
        for kind in KINDS:
            for every in (100, 10):
                got[f"{kind}/{every}"] = replay_us(n.graph(kind, every, a.chain), a.reps)
        rounds.append(got)
    rows = []
    for key in rounds[0]:
        kind, every = key.split("/")
        extra = [0 if int(every) == 0 else a.chain // int(every)] * 2
        per_node = [(r[key] - r["none/0"]) / e if e else 0.0 for r, e in zip(rounds, extra)]
        rows.append({"kind": kind, "every": int(every), "replay_us": [r[key] for r in rounds],
                     "us_per_extra_node": per_node})
        print(f"{key:20s} replay {' / '.join(f'{r[key]:7.1f}' for r in rounds)} us; per extra node "
              f"{' / '.join(f'{p:+6.2f}' for p in per_node)} us")
    report["chain"] = a.chain
    report["rows"] = rows


def probe_unpin(report: dict) -> None:
    rt = torch.cuda.cudart()
    x = torch.ones(1024, device="cuda")
    for mode in ("none", "unregister"):
        m = mmap.mmap(-1, 1 << 20)
        t = torch.from_numpy(np.frombuffer(m, dtype=np.uint8))
        ptr = t.data_ptr()
        if int(rt.cudaHostRegister(ptr, 1 << 20, 0)) != 0:
            raise RuntimeError("cudaHostRegister failed")
        torch.cuda.synchronize()
        res: dict = {}
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                if mode == "unregister":
                    res["unregister_error"] = int(rt.cudaHostUnregister(ptr))
                y = x + 1
            g.replay()
            torch.cuda.synchronize()
            res["replay_ok"] = bool((y == 2).all())
        except Exception as e:  # noqa: BLE001 -- what the capture does is the result
            res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        if mode == "none":
            rt.cudaHostUnregister(ptr)
        report[mode] = res
        print(f"{mode}: {res}")


def main(argv=None) -> int:
    a = parse_args(argv)
    if not common.out_ok(a.out, "probe_graph_nodes"):
        return 2
    if not torch.cuda.is_available():
        print("probe_graph_nodes: needs a CUDA GPU (none here)", file=sys.stderr)
        return 2
    report = {"benchmark": "probe_graph_nodes", "probe": a.probe, "env": common.environment()}
    if a.probe == "nodes":
        probe_nodes(a, report)
    else:
        probe_unpin(report)
    if a.out:
        common.write_json(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
