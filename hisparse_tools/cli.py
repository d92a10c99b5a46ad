"""The ``hisparse`` command: ``stress``, ``autotune``, ``plan``, ``env``, ``mini-engine``, ``whatif``.

Every subcommand has ``--help``, prints a readable table (or ``--json``: the result
dict as JSON on stdout, nothing else there), shows progress on stderr for long work
(``--quiet`` turns it off), checks its output paths, device, kernels, options
(:mod:`hisparse_tools.flag_rules`) and memory before any work starts, and reports a
failure as one line on stderr with an exit status (:mod:`hisparse_tools.exit_codes`;
every ``--help`` ends with the table, and ``docs/CLI.md`` has the cases):

  0  success
  1  the run itself failed (stress: a verification mismatch; mini-engine: outputs differ)
  2  bad arguments or input
  3  a capacity limit (nothing fits the budget, the pool or the machine's memory)
  4  a missing dependency (CUDA, Triton's interpreter, matplotlib, prometheus_client)

``python -m hisparse_tools ...`` is the same command; ``hisparse --version`` prints the version.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Sequence

from hisparse import __version__
from hisparse import metrics as prom
from hisparse.config import Kernels
from hisparse.errors import CapacityError
from . import flag_rules, mini_engine
from .autotune import AutotuneOptions, format_autotune, run_autotune, save_result
from .env import collect_env, format_env
from .exit_codes import (EXIT_FAILED, EXIT_INPUT, EXIT_OK, MissingDependency, OneLineParser, flag_names,
                         run_command, writing)
from .plan import FORMULAS, PlanInputs, format_plan, plan
from .outputs import Outputs
from .preflight import parse_device, path_arg
from .report import plot_stress, require_matplotlib
from .stress_report import format_stress
from .traces import SOURCES
from .units import fmt_bytes, parse_bytes, parse_count, rows_arg, token_arg
from .workload import StressOptions

# every command's --help ends with it (explicit line breaks: plan's help is not re-wrapped)
EXIT_TABLE = ("exit status: 0 ok, 1 run failed, 2 bad input, 3 capacity, 4 missing dependency,\n"
              "130 interrupted, 141 stdout's reader left. An error is one line on stderr:\n"
              "`hisparse COMMAND: KIND: message`.\n"
              f"Options: {flag_rules.RULE}.\n"
              "`hisparse COMMAND --help` lists a command's options.")
KERNEL_NAMES = [k.value for k in Kernels]


def _verify_arg(text: str) -> int | str:
    if text in ("all", "none"):
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count, 'all' or 'none', got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"verify count must be >= 0, got {n}")
    return n


def _bytes(text: str) -> int:
    try:
        n = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"a memory budget must be > 0, got {text!r}")
    return n


def _pool_rows(text: str) -> int | str:
    """``--pool-rows``: a row count (``64K`` ...) or ``auto``."""
    return "auto" if text == "auto" else rows_arg(text)


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be in [1, 65535], got {n}")
    return n


def _emit(args, result: dict[str, Any], text: str) -> None:
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    else:
        print(text)


# ------------------------------------------------------------------ stress
STRESS_PRESETS = {
    "small": {},  # the StressOptions defaults: < 1 minute on a 2-core CPU
    "gpu": dict(num_requests=64, context=128 * 1024, context_min=96 * 1024, num_layers=4,
                top_k=2048, buffer_size=4096, steps=100, verify=256, device="cuda"),
}
# StressOptions fields a replayed trace fixes, and their flags (refused next to --replay)
REPLAY_FIXED = {"num_requests": "--requests", "context": "--context", "context_min": "--context-min",
                "num_layers": "--layers", "top_k": "--top-k", "steps": "--steps",
                "churn": "--churn", "drift": "--drift"}
STRESS_FIELDS = ("num_requests", "context", "context_min", "num_layers", "top_k", "buffer_size",
                 "row_format", "steps", "churn", "trace", "drift", "replay", "record", "verify",
                 "seed", "device", "block_size", "kernels", "optimal", "checked", "prefetch", "pool_rows", "ramp",
                 "shared_prefix", "prefix_groups")


def _add_stress(sub) -> None:
    d = StressOptions()
    p = sub.add_parser(
        "stress", help="long-context stress run of the real cache with byte-exact verification",
        description=(
            "Drive the cache with many requests x long contexts x layers for a number of decode "
            "steps, requests joining and leaving; verify physical rows byte-exact against the "
            "host copy every step (a mismatch fails the run, exit 1); report hit rate vs the "
            "Belady optimum, H2D bytes and GB/s, step time p50/p99 and memory. With no "
            "arguments: a small CPU-sized run (< 1 min). GPU size: --preset gpu "
            "(64 requests x 128K context x 4 layers, K=2048, S=4096). --pool-rows N adds the "
            "elastic device tier (requests resident in device pages until a spill demotes them "
            "to hot buffers); --ramp then adds requests until the pool overflows and lets them "
            "leave one by one, verifying every resolved row across the spills. --shared-prefix P runs the "
            "cache with prefix caching: prompts in --prefix-groups G groups share P tokens, follow-up turns "
            "extend requests that left; only uncached rows are prefilled, shared rows verified like any other, "
            "and the host pool must be empty once all leave and the prefix cache is reset. Defaults in "
            "[brackets]."),
        epilog=EXIT_TABLE)
    p.add_argument("--preset", choices=sorted(STRESS_PRESETS), default="small",
                   help="base sizes; explicit flags override [small]")
    a = p.add_argument
    a("--requests", dest="num_requests", type=int, help=f"live requests at once [{d.num_requests}]")
    a("--context", type=token_arg, help=f"max context of a joining request, e.g. 128K, 1M [{d.context}]")
    a("--context-min", type=token_arg, help="min context of a joining request [context/2]")
    a("--layers", dest="num_layers", type=int, help=f"layers [{d.num_layers}]")
    a("--top-k", type=int, help=f"indexer top-k K [{d.top_k}]")
    a("--buffer", dest="buffer_size", type=int, help="hot LRU slots S per (layer, request) [2*K]")
    a("--format", dest="row_format", choices=["fp8_ds_mla", "bf16"], help=f"row format [{d.row_format.value}]")
    a("--steps", type=int, help=f"decode steps [{d.steps}]")
    a("--churn", type=float, help=f"per step and request: probability it leaves [{d.churn}]")
    a("--trace", choices=list(SOURCES), help=f"top-k source [{d.trace.value}]")
    a("--drift", type=float, help="correlated: fraction replaced per step; indexer: query drift; workingset: "
                                  "candidates replaced per step [0.1; workingset 0.03]")
    a("--replay", type=path_arg, metavar="FILE",
      help="replay a recorded .npz trace (implies --trace replay; the trace fixes layers, top-k, "
           "steps and the request schedule, so those flags are refused next to it)")
    a("--record", type=path_arg, metavar="FILE", help="write the trace used to this .npz (format: hisparse_tools.traces)")
    a("--verify", type=_verify_arg, help=f"rows checked per layer and step, 'all' or 'none' [{d.verify}]")
    a("--seed", type=int, help=f"seed [{d.seed}]")
    a("--device", help="cpu, cuda or cuda:N [cuda if available]")
    a("--block-size", type=int, help=f"host block size [{d.block_size}]")
    a("--kernels", choices=KERNEL_NAMES,
      help=f"cache kernels; triton on a CPU device needs TRITON_INTERPRET=1 [{d.kernels.value}]")
    a("--no-optimal", dest="optimal", action="store_false", default=None,
      help="skip the Belady bound (saves host memory on huge runs)")
    a("--unchecked", dest="checked", action="store_false", default=None,
      help="resolve without the host-syncing input check (times the fast path)")
    a("--prefetch", action="store_true", default=None,
      help="after each layer's resolve, stage its selection into the next layer (exact into a layer "
           "that shares it, e.g. the Shared layers of a `mini-engine --index-share 2 --record` trace; "
           "a prediction into the others); reports precision, recall, evicted rows and wasted bytes")
    a("--pool-rows", type=rows_arg, default=None, metavar="N",
      help="device rows per layer shared by all requests, hot buffers included (HiSparseConfig."
           "device_pool_rows): the rows past the hot buffers are pages of 64 that hold whole contexts of "
           "resident requests; at least --requests x (S + 1) rounded up to 64, plus one page [none: every "
           "request hot]")
    a("--ramp", action="store_true", default=None,
      help="with --pool-rows: a load ramp instead of --steps/--churn: one request joins per step (every "
           "live one appending a row) until the pool has overflowed (a spill left a request hot), then the "
           "oldest leaves each step until none is left; every resolved row verified [--verify all]")
    a("--shared-prefix", type=token_arg, default=None, metavar="P",
      help="prefix caching (HiSparseConfig.prefix_caching): every fresh prompt starts with its group's P shared "
           "tokens (e.g. 1K), at least one host block and below --context-min; joining requests are also "
           "follow-up turns (a request that left, its generated tokens and a new turn); reports the prefix hit "
           "rate, host and prefill rows saved, cached / shared blocks and evictions; no Belady bound [off]")
    a("--prefix-groups", type=int, default=None, metavar="G",
      help="with --shared-prefix: groups of requests, each sharing its own prefix [1]")
    a("--plot", type=path_arg, metavar="DIR", help="write hit_rate.png and step_time.png there (needs matplotlib)")
    a("--metrics-file", type=path_arg, metavar="FILE",
      help="write the cache's stats() there in the Prometheus text format (hisparse_* metrics), "
           "at the end and every --metrics-every steps")
    a("--metrics-every", type=parse_count, default=None, metavar="N",
      help=f"steps between --metrics-file writes; 0: only at the end [{flag_rules.STRESS_METRICS_EVERY}]")
    a("--metrics-port", type=_port, metavar="PORT",
      help="serve the metrics on http://ADDR:PORT/metrics while the run lasts (needs prometheus_client)")
    a("--metrics-addr", default=None, metavar="ADDR",
      help=f"address of --metrics-port [{flag_rules.STRESS_METRICS_ADDR}]")
    p.set_defaults(func=_cmd_stress)


def _stress_options(args) -> StressOptions:
    """The options from the preset and the explicit flags; conflicting flags refused."""
    if args.replay:
        if args.trace not in (None, "replay"):
            raise ValueError(f"--replay FILE replays a recorded trace and --trace {args.trace} "
                             "generates one: give one of them")
        given = [flag for f, flag in REPLAY_FIXED.items() if getattr(args, f) is not None]
        if given:
            raise ValueError(f"--replay FILE: the trace fixes the layers, top-k, steps and request "
                             f"schedule, so {', '.join(given)} would be ignored; drop "
                             f"{'it' if len(given) == 1 else 'them'}")
    kw = dict(STRESS_PRESETS[args.preset])
    for f in STRESS_FIELDS:
        v = getattr(args, f)
        if v is not None:
            kw[f] = v
    if args.ramp and args.verify is None:
        kw["verify"] = "all"  # a ramp checks every resolved entry unless --verify says otherwise
    if "context" in kw and args.context_min is None and kw.get("context_min", 0) > kw["context"]:
        del kw["context_min"]  # a preset's minimum above an explicit --context: use the default
    if args.replay:
        kw["trace"] = "replay"
    return StressOptions(progress=not args.quiet, **kw)


def _cmd_stress(args) -> int:
    flag_rules.check_stress(args)
    with Outputs() as outs:
        return _stress(args, outs)


def _stress(args, outs: Outputs) -> int:
    # outputs and optional dependencies first: nothing runs before they are known good
    outs.input(args.replay, flag="--replay")
    outs.file(args.record, flag="--record")
    outs.directory(args.plot, flag="--plot", files=("hit_rate.png", "step_time.png"))
    outs.file(args.metrics_file, flag="--metrics-file", replace=True)
    if args.plot:
        require_matplotlib()
    if args.metrics_port is not None and not prom.prometheus_client_available():
        raise MissingDependency("--metrics-port needs prometheus_client, which is not installed "
                                "(`pip install prometheus_client`); or use --metrics-file")
    from .stress import StressRun  # the real cache: loaded when a stress run starts

    run = StressRun(_stress_options(args), outputs=outs)  # device, kernels, trace file, config, memory
    latest: dict[str, Any] = {}
    server = None
    if args.metrics_port is not None:
        try:
            server = prom.start_metrics_server(args.metrics_port, lambda: latest.get("stats", {}),
                                               addr=args.metrics_addr)
        except OSError as e:
            raise ValueError(f"--metrics-port {args.metrics_port}: cannot listen on "
                             f"{args.metrics_addr}:{args.metrics_port} ({e.strerror or e})") from None

    def on_step(done: int, stats: dict[str, Any]) -> None:
        latest["stats"] = stats
        if args.metrics_file and args.metrics_every and done % args.metrics_every == 0:
            with writing("--metrics-file", args.metrics_file):
                prom.write_metrics_file(args.metrics_file, stats)

    try:
        r = run.run(on_step)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    if args.metrics_file and "stats" in latest:
        with writing("--metrics-file", args.metrics_file):
            prom.write_metrics_file(args.metrics_file, latest["stats"])
        r["metrics_file"] = args.metrics_file
    if args.plot:
        ps = r["per_step"]
        with writing("--plot", args.plot):
            r["plots"] = plot_stress(args.plot, hit_rate=ps["hit_rate"], optimal=ps["optimal_hit_rate"],
                                     step_ms=ps["step_ms"])
    text = format_stress(r)
    if args.plot:
        text += "\nplots: " + ", ".join(r["plots"])
    if args.metrics_file:
        text += f"\nmetrics: {args.metrics_file}"
    _emit(args, r, text)
    return EXIT_OK if r["ok"] else EXIT_FAILED


# ------------------------------------------------------------------ autotune
# the cache config's fields that an autotune flag sets under another name, for error messages
AUTOTUNE_CONFIG_FLAGS = {"device_buffer_size": "--buffer", "device_pool_rows": "--pool-rows"}


def _add_autotune(sub) -> None:
    d = AutotuneOptions()
    p = sub.add_parser(
        "autotune", help="largest decode batch that fits GPU memory, and the fastest one",
        description=(
            "Find the largest max_num_reqs whose hot buffers, slot/LRU state, resolve buffers and "
            "attention I/O fit --gpu-memory; warm the cache and attention backend at candidate "
            "batches, time decode steps, pick the best tokens/s under --latency-ms. Writes JSON "
            "(--out) that hisparse_tools.autotune.load_tuned_config() loads (it refuses a "
            "result from another GPU or library version). Without a GPU it runs on CPU and "
            "says the timings are CPU timings. It also reports the largest device pool (the "
            "elastic tier) the budget leaves at the chosen batch; --pool-rows auto puts it in "
            "the config."),
        epilog=EXIT_TABLE)
    a = p.add_argument
    a("--layers", dest="num_layers", type=int, default=d.num_layers, help=f"layers [{d.num_layers}]")
    a("--format", dest="row_format", choices=["fp8_ds_mla", "bf16"], default=d.row_format.value,
      help=f"KV row format [{d.row_format.value}]")
    a("--top-k", type=int, default=d.top_k, help=f"indexer top-k K [{d.top_k}]")
    a("--buffer", dest="buffer_size", type=int, default=None, help="hot LRU slots S [2*K]")
    a("--context", type=token_arg, default=d.context, help=f"context per request while timing [{d.context}]")
    a("--query-len", dest="max_query_len", type=int, default=1, help="decode tokens per request per step")
    a("--heads", dest="num_heads", type=int, default=d.num_heads, help=f"attention heads [{d.num_heads}]")
    a("--gpu-memory", type=_bytes, default=None,
      help="budget, e.g. 40GiB [90%% of free GPU memory; required on CPU]")
    a("--host-memory", type=_bytes, default=None, help="host pool budget [half the machine's RAM]")
    a("--max-reqs", type=int, default=1024, help="upper bound of the batch search [1024]")
    a("--reserve-frac", type=float, default=d.reserve_frac, help=f"slack on top [{d.reserve_frac}]")
    a("--latency-ms", type=float, default=None, help="max median step time")
    a("--steps", type=int, default=d.steps, help=f"timed steps per batch [{d.steps}]")
    a("--warmup", type=int, default=d.warmup, help=f"warm-up steps per batch [{d.warmup}]")
    a("--candidates", dest="max_candidates", type=int, default=d.max_candidates,
      help=f"batches to time [{d.max_candidates}]")
    a("--block-size", type=int, default=d.block_size, help=f"host block size [{d.block_size}]")
    a("--device", default=None, help="cpu, cuda or cuda:N [cuda if available]")
    a("--backend", default=None, help="preferred attention backend name")
    a("--flashmla-lib", default=None, help="FlashMLA library path [$HISPARSE_FLASHMLA_LIB]")
    a("--pool-rows", type=_pool_rows, default=None, metavar="N|auto",
      help="device pool (the elastic tier, HiSparseConfig.device_pool_rows) in the config: auto = the largest "
           "the budget leaves at the chosen batch (always reported); N = a fixed pool, hot buffers included, "
           "that the batch search leaves at least one page of 64 rows; timed steps run without it [none]")
    a("--out", type=path_arg, metavar="FILE", help="write the JSON result here")
    p.set_defaults(func=_cmd_autotune)


def _cmd_autotune(args) -> int:
    flag_rules.check_autotune(args)
    with Outputs() as outs:
        return _autotune(args, outs)


def _autotune(args, outs: Outputs) -> int:
    outs.file(args.out, flag="--out")
    o = AutotuneOptions(
        num_layers=args.num_layers, row_format=args.row_format, top_k=args.top_k,
        buffer_size=args.buffer_size, context=args.context, max_query_len=args.max_query_len,
        num_heads=args.num_heads, gpu_memory=args.gpu_memory, host_memory=args.host_memory,
        max_reqs=args.max_reqs, reserve_frac=args.reserve_frac,
        latency_ms=args.latency_ms, steps=args.steps, warmup=args.warmup,
        max_candidates=args.max_candidates, block_size=args.block_size, device=args.device,
        backend=args.backend, progress=not args.quiet, pool_rows=args.pool_rows,
        flashmla_lib=args.flashmla_lib or os.environ.get("HISPARSE_FLASHMLA_LIB") or None)
    r = run_autotune(o)
    if args.out:
        with writing("--out", args.out), outs.open(args.out) as fh:
            save_result(r, fh)
    text = format_autotune(r) + (f"\nwrote {args.out}" if args.out else "")
    _emit(args, r, text)
    return EXIT_OK


# ------------------------------------------------------------------ plan
def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan", help="capacity planner: concurrent requests with and without hisparse",
        description="Concurrent requests without hisparse (all rows on the GPU) and with it (hot "
                    "buffers + indexer keys on the GPU, rows on host); which resource binds; the "
                    "host pool a target concurrency needs. Exit 3 when not even one request "
                    "fits with hisparse.\n\nFormulas:" + FORMULAS,
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXIT_TABLE)
    a = p.add_argument
    a("--layers", dest="num_layers", type=int, default=61, help="layers L (default 61)")
    a("--format", dest="row_format", choices=["fp8_ds_mla", "bf16"], default="fp8_ds_mla",
      help="KV row format (default fp8_ds_mla)")
    a("--top-k", type=int, default=2048, help="K (default 2048)")
    a("--indexer-bytes", type=int, default=132, help="indexer bytes per token per layer I (default 132)")
    a("--index-share", type=int, default=1, metavar="N",
      help="only every N-th layer runs an indexer (keeps keys); the others reuse its top-k, as "
           "IndexCache-style models do (default 1: every layer)")
    a("--context", dest="context_len", type=token_arg, default=128 * 1024, help="context C (default 128K)")
    a("--gpu-memory", dest="gpu_bytes", type=_bytes, default=80 << 30, help="GPU bytes for KV G (default 80GiB)")
    a("--host-memory", dest="host_bytes", type=_bytes, default=1 << 40, help="host pool bytes Hm (default 1TiB)")
    a("--hot-rows", type=int, default=None, help="hot rows per request S (default 2*K)")
    a("--max-seqs", type=int, default=1024, help="max sequences M (default 1024)")
    a("--block-size", type=int, default=64, help="host block size B (default 64)")
    a("--target", dest="target_requests", type=int, default=None, help="target concurrency")
    a("--tp", dest="tp_ranks", type=int, default=1,
      help="tensor-parallel ranks per node P; --gpu-memory is per rank (default 1)")
    a("--tp-share", action="store_true",
      help="the TP ranks of a node share one host pool (count it once per node)")
    a("--pool-rows", type=_pool_rows, default=None, metavar="N|auto",
      help="a device pool of N rows per layer, hot buffers included (the elastic tier, HiSparseConfig."
           "device_pool_rows) for the --target requests, else the hisparse concurrency: its GPU bytes, the "
           "requests it holds resident at --context, the rows that would hold all of them; auto: every GPU "
           "byte those requests leave")
    a("--shared-prefix", type=token_arg, default=None, metavar="P",
      help="prefix caching: the requests share the first P of their --context tokens in --prefix-groups groups; "
           "reports the host pool rows with and without sharing, the alias ids (prefix_alias_blocks) and their "
           "device memory, and the concurrency with sharing")
    a("--prefix-groups", type=int, default=None, metavar="G",
      help="with --shared-prefix: groups of requests, each sharing its own prefix (default 1)")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args) -> int:
    flag_rules.check_plan(args)
    r = plan(PlanInputs(num_layers=args.num_layers, context_len=args.context_len,
                        gpu_bytes=args.gpu_bytes, host_bytes=args.host_bytes,
                        row_format=args.row_format, top_k=args.top_k,
                        indexer_bytes=args.indexer_bytes, index_share=args.index_share,
                        hot_rows=args.hot_rows, max_seqs=args.max_seqs, block_size=args.block_size,
                        target_requests=args.target_requests, tp_ranks=args.tp_ranks,
                        tp_share=args.tp_share, pool_rows=args.pool_rows, shared_prefix=args.shared_prefix,
                        prefix_groups=args.prefix_groups))
    c, b = r["concurrency"], r["per_request_bytes"]
    if c["hisparse"] == 0:
        raise CapacityError(
            f"not even one request fits with hisparse (binding: {r['binding']}): one request needs "
            f"{fmt_bytes(b['hisparse_gpu'])} of GPU memory (--gpu-memory {fmt_bytes(args.gpu_bytes)}) "
            f"and {fmt_bytes(b['hisparse_host'] * r['host_pool_copies_per_node'])} of host pool "
            f"(--host-memory {fmt_bytes(args.host_bytes)})")
    _emit(args, r, format_plan(r))
    return EXIT_OK


# ------------------------------------------------------------------ env
def _add_env(sub) -> None:
    p = sub.add_parser("env", help="GPU, driver, versions, pinned memory, attention backends",
                       description="What this machine offers hisparse: GPU, driver, torch/triton/cupy "
                                   "versions, a pinned-memory check, and which attention backends are "
                                   "available (and why not).", epilog=EXIT_TABLE)
    p.add_argument("--device", default=None, help="device the checks describe: cpu, cuda or cuda:N "
                                                  "[cuda if available]")
    p.add_argument("--flashmla-lib", default=None, help="FlashMLA library path to try "
                                                        "(default $HISPARSE_FLASHMLA_LIB)")
    p.set_defaults(func=_cmd_env)


def _cmd_env(args) -> int:
    flag_rules.check_env(args)
    dev = parse_device(args.device, available=False)
    d = collect_env(device=str(dev), flashmla_lib=args.flashmla_lib)
    _emit(args, d, format_env(d))
    return EXIT_OK


# ------------------------------------------------------------------ mini-engine
def _add_mini_engine(sub) -> None:
    p = sub.add_parser("mini-engine", help="random-weight sparse-MLA engine: resident vs hisparse",
                       description="Serve a random-weight sparse-MLA model twice (resident KV and "
                                   "hisparse), check the outputs match, compare speed.",
                       epilog=EXIT_TABLE)
    mini_engine.build_parser(p)
    p.set_defaults(func=mini_engine.run_args)


# ------------------------------------------------------------------ main
def _top_help(prog: str) -> argparse.HelpFormatter:
    # wide enough that every subcommand's help stays on its own line
    return argparse.HelpFormatter(prog, max_help_position=20, width=100)


class _CommandParser(OneLineParser):
    """A command's parser: an argument after the command that it does not know is its
    error (its --help lists what it takes), not the top-level parser's."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="hisparse", description="hisparse: tiered KV cache for sparse-MLA attention "
                                     "(`hisparse COMMAND --help` for each command).",
        epilog=EXIT_TABLE, formatter_class=_top_help)
    parser.add_argument("--version", action="version", version=f"hisparse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    adders: list[Callable] = [_add_stress, _add_autotune, _add_plan, _add_env]
    for add in adders:
        add(sub)
    for name in ("stress", "autotune", "plan", "env"):
        sp = sub.choices[name]
        sp.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        sp.add_argument("--quiet", action="store_true", help="no progress output on stderr")
    _add_mini_engine(sub)
    from . import whatif  # registers itself; its run function returns the exit status

    whatif.add_parser(sub).epilog = EXIT_TABLE
    for name, sp in sub.choices.items():  # errors name the options as typed (run_command)
        extra = {"mini-engine": mini_engine.CONFIG_FLAGS, "autotune": AUTOTUNE_CONFIG_FLAGS}.get(name, {})
        sp.set_defaults(flag_names={**flag_names(sp), **extra})
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hisparse`` command; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (EXIT_INPUT if e.code else EXIT_OK)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_INPUT
    return run_command(args.command, lambda: args.func(args), flags=args.flag_names)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
