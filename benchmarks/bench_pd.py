"""Prefill/decode transfer through NIXL (``hisparse.pd``) against a plain bulk copy of
the same bytes on the same machine.

Two processes: this one is the decode side (a ``HiSparseCache`` whose host pool a
``PDReceiver`` registered); a spawned one is the prefill side (a ``PDSender``, rows in
host memory or, with ``--device cuda``, in GPU memory). Per request: the decode side
reserves N x C tokens' blocks, the prefill side writes C rows x L layers and notifies,
the decode side commits, then checks every byte against the rows (regenerated from the
request's seed). The baseline copies L x C x row_bytes contiguous bytes from the
prefill device into the pinned pool (``copy_``: memcpy on CPU, device -> host on CUDA).

Reports min / median / p99 of: transfer GB/s (the sender's first post to its last
completion), bulk-copy GB/s and their ratio, reserve and commit bookkeeping us per
request (commit: the poll that reads the "done" notice and commits, which includes the
write of the rows into every layer; ``commit_call_us``: the ``commit`` call inside it
alone), and end-to-end ms (reserve to committed). Writes ``--out`` JSON.

  python -m benchmarks.bench_pd [--requests 8] [--tokens 1024] [--layers 4] [--row-bytes 656]
      [--block 64] [--reps 3] [--per-layer] [--device cpu|cuda] [--no-verify] [--out FILE]

The issue's target case: ``--requests 1 --tokens 32768 --layers 61`` (1.3 GB a request).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import torch

from benchmarks import common


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=common.positive_int, default=8, help="requests per rep (N)")
    ap.add_argument("--tokens", type=common.positive_int, default=1024, help="tokens per request (C)")
    ap.add_argument("--layers", type=common.positive_int, default=4, help="layers (L)")
    ap.add_argument("--row-bytes", type=int, choices=(656, 1152), default=656)
    ap.add_argument("--block", type=common.positive_int, default=64, help="host block size (tokens)")
    ap.add_argument("--reps", type=common.positive_int, default=3, help="rounds of N requests")
    ap.add_argument("--per-layer", action="store_true", help="one NIXL transfer per layer (default: one for all)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the prefill side's rows are")
    ap.add_argument("--no-verify", action="store_true", help="skip the byte check after each commit")
    ap.add_argument("--timeout", type=common.positive_float, default=120.0, help="seconds a request may take")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def request_rows(seed: int, tokens: int, row_bytes: int, layers: int, device: str) -> list[torch.Tensor]:
    """uint8 [C, row_bytes] per layer, the same for a seed on both sides."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (tokens, row_bytes), dtype=torch.uint8, generator=g).to(device)
            for _ in range(layers)]


def prefill_side(conn, row_format: str, block: int, device: str, per_layer: bool) -> None:
    from hisparse.pd import PDDescriptor, PDSender
    try:
        tx = PDSender(row_format=row_format, block_size=block)
    except Exception as e:  # noqa: BLE001 -- reported to the decode side, which stops
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send("ready")
    while (job := conn.recv()) is not None:
        data, seed = job
        try:
            desc = PDDescriptor.from_bytes(data)
            rows = request_rows(seed, desc.num_tokens, desc.row_bytes, desc.num_layers, device)
            rep = tx.send(desc, rows, per_layer=per_layer)
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))
            return
        conn.send((rep.bytes, rep.seconds))


def from_prefill(conn, proc, timeout_s: float):
    """The prefill process's next message; RuntimeError when it reports an error, exits
    or says nothing for ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"the prefill process exited (code {proc.exitcode})")
        if time.monotonic() > end:
            raise RuntimeError(f"the prefill process said nothing for {timeout_s:.0f} s")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise RuntimeError(f"prefill side: {msg[1]}")
    return msg


def bulk_copy_gbps(nbytes: int, device: str, pool: torch.Tensor, reps: int) -> list[float]:
    """GB/s of ``pool[:nbytes].copy_(src)`` with ``src`` (uint8 [nbytes]) on ``device``.
    pool: uint8 [host_pool_bytes], the cache's pinned host pool (``pool.buffer.tensor``)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).to(device)
    dst = pool[:nbytes]
    out = []
    for _ in range(reps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out[1:]  # the first one warms up


def main(argv=None) -> int:
    a = parse_args(argv)
    if not common.out_ok(a.out, "bench_pd"):
        return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_pd: --device cuda needs a CUDA GPU (none here)", file=sys.stderr)
        return 4
    from hisparse import HiSparseCache, HiSparseConfig, RowFormat
    from hisparse.pd import PDReceiver, nixl_available
    why = nixl_available()
    if why is not None:
        print(f"bench_pd: {why}", file=sys.stderr)
        return 4
    N, C, L, rb = a.requests, a.tokens, a.layers, a.row_bytes
    blocks = -(-C // a.block) * N
    cfg = HiSparseConfig(num_layers=L, host_pool_tokens=blocks * a.block, row_bytes=rb, top_k=64,
                         device_buffer_size=128, max_num_reqs=N, max_query_len=1, host_block_size=a.block,
                         max_request_id=max(1024, N * a.reps + 1),
                         device="cuda" if torch.cuda.is_available() else "cpu")
    report = {"benchmark": "bench_pd", "env": common.environment(a.device if a.device == "cuda" else None),
              "args": vars(a), "bytes_per_request": L * C * rb}
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    row_format = next(f.value for f in RowFormat if f.row_bytes == rb)  # --row-bytes: 656 or 1152
    proc = ctx.Process(target=prefill_side, args=(theirs, row_format, a.block, a.device, a.per_layer), daemon=True)
    proc.start()
    try:
        cache = HiSparseCache(cfg)
        # the baseline first: the decode agent's progress thread (started next) takes a core
        bulk = bulk_copy_gbps(L * C * rb, a.device, cache.pool.buffer.tensor, max(3, a.reps))
        rx = PDReceiver(cache)
        if from_prefill(mine, proc, 120) != "ready":
            raise RuntimeError("the prefill process did not start")
        xfer, reserve_us, commit_us, e2e_ms, call_us = [], [], [], [], []
        commit = rx.commit

        def timed_commit(req_id: int, generation: int) -> None:  # what the poll's commit alone takes
            t = time.perf_counter()
            try:
                commit(req_id, generation)
            finally:
                call_us.append((time.perf_counter() - t) * 1e6)

        rx.commit = timed_commit
        verified = 0
        rid = 0
        for _rep in range(a.reps):
            for _ in range(N):
                rid += 1
                t0 = time.perf_counter()
                desc = rx.reserve(rid, C)
                t1 = time.perf_counter()
                mine.send((desc.to_bytes(), rid))
                nbytes, seconds = from_prefill(mine, proc, a.timeout)
                # the notice is on its way or here: poll until the poll that commits it
                end = time.monotonic() + a.timeout
                while True:
                    t2 = time.perf_counter()
                    res = rx.poll()
                    t3 = time.perf_counter()
                    if rid in res.committed:
                        break
                    if rid in res.failed or time.monotonic() > end:
                        raise RuntimeError(f"request {rid}: {res.failed.get(rid, 'no notice in time')}")
                t4 = t3
                reserve_us.append((t1 - t0) * 1e6)
                commit_us.append((t3 - t2) * 1e6)  # the poll that read the notice and committed
                e2e_ms.append((t4 - t0) * 1e3)
                xfer.append(nbytes / seconds / 1e9)
                if not a.no_verify:
                    want = request_rows(rid, C, rb, L, "cpu")
                    for layer in range(L):
                        if not torch.equal(cache.read_host_rows(layer, rid, list(range(C))), want[layer]):
                            raise RuntimeError(f"request {rid} layer {layer}: bytes differ after commit")
                    verified += 1
            for r in cache.live_requests():
                cache.free_request(r)
        book = [r + c for r, c in zip(reserve_us, commit_us)]
        report.update(transfer_gbps=common.stats(xfer), bulk_copy_gbps=common.stats(bulk),
                      ratio_median=common.stats(xfer)["median"] / common.stats(bulk)["median"],
                      reserve_us=common.stats(reserve_us), commit_us=common.stats(commit_us),
                      commit_call_us=common.stats(call_us),
                      bookkeeping_us=common.stats(book), end_to_end_ms=common.stats(e2e_ms),
                      verified_requests=verified)
        rx.close()
        mine.send(None)
    except Exception as e:  # the JSON records the failure too
        rc = common.record_failure(report, e)
        if a.out:
            common.write_json(a.out, report)
        return rc
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    t, b = report["transfer_gbps"], report["bulk_copy_gbps"]
    print(f"{N} x {C} tokens x {L} layers x {rb} B ({L * C * rb / 1e6:.1f} MB a request), prefill rows on "
          f"{a.device}, {'per layer' if a.per_layer else 'one transfer'}")
    print(f"NIXL WRITE GB/s min/median/p99 {t['min']:.2f} / {t['median']:.2f} / {t['p99']:.2f}; bulk copy "
          f"{b['min']:.2f} / {b['median']:.2f} / {b['p99']:.2f}; ratio {report['ratio_median']:.2f}x")
    k = report["bookkeeping_us"]
    print(f"reserve + commit us min/median/p99 {k['min']:.0f} / {k['median']:.0f} / {k['p99']:.0f} "
          f"(reserve median {report['reserve_us']['median']:.0f}, commit {report['commit_us']['median']:.0f}, "
          f"of it the commit call {report['commit_call_us']['median']:.0f}); "
          f"verified {verified} requests")
    if a.out:
        common.write_json(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
