"""``hisparse mini-engine``: flags (one per :class:`MiniEngineConfig` field), presets, run.

Flags shared with the other subcommands are spelled as there (``--layers``,
``--requests``, ``--heads``, ``--format``, ``--buffer``, ``--block-size``, ``--kernels``,
``--quiet``); the former spellings made from field names (``--num-layers``, ...) and
``--progress`` still work, hidden from ``--help``, with a note on stderr.

Errors follow the ``hisparse`` command's exit codes (:mod:`hisparse_tools.exit_codes`):
1 when the outputs differ beyond ``--tolerance``, 2 bad input, 3 capacity, 4 missing
dependency. ``--out`` and ``--record`` are checked before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys

from hisparse.config import Kernels
from hisparse.decode import Overlap
from ..exit_codes import EXIT_FAILED, EXIT_OK, OneLineParser, flag_names, run_command, writing
from ..fields import choice_values
from ..flag_rules import check_mini_engine
from ..outputs import Outputs
from ..preflight import path_arg
from ..units import rows_arg
from .config import PRESETS, MiniEngineConfig
from .ffn import FFNKind, FFNRouting
from .report import format_report

# the choice fields' spellings (the config parses them to its enum members)
_CHOICES = {"row_format": ["fp8_ds_mla", "bf16"], "cache_kernels": choice_values(Kernels),
            "overlap": [v for v in choice_values(Overlap) if v != Overlap.AUTO.value], "ffn": choice_values(FFNKind), "ffn_routing": choice_values(FFNRouting)}


# boolean fields as switches: field -> (flag, argparse action, help)
_SWITCHES = {
    "graphs": ("--graphs", "store_true",
               "run decode-only steps as CUDA graphs per batch-size bucket (CUDA; runs unchecked)"),
    "layer_graphs": ("--layer-graphs", "store_true",
                     "run decode-only steps eagerly, padded to batch-size buckets, each of hisparse's per-layer "
                     "calls replaying a small CUDA graph (an eager engine's host cost; CUDA, serial; runs "
                     "unchecked)"),
    "prefetch": ("--prefetch", "store_true",
                 "hisparse: stage layer l's top-k into layer l+1 while layer l computes: into Shared layers "
                 "(exact, --index-share > 1), and into Full layers as a prediction when --index-correlation > 0"),
    "prefix_reuse": ("--prefix-reuse", "store_true",
                     "hisparse: prefix caching: a request is admitted with its prompt's token ids and computes only "
                     "the tokens past its cached blocks (the engine keeps their indexer keys); outputs of the "
                     "skipped positions are left out of the comparison"),
    "async_steps": ("--sync-steps", "store_false",
                    "CUDA: finish each step before preparing the next (default: the host prepares step t + 1 "
                    "while step t runs, one step ahead)"),
}


# fields whose flag is spelled as in stress, plan, autotune and whatif; the spelling made
# from the field name (--num-layers, ...) is kept as a hidden former spelling
_FLAGS = {"num_layers": "--layers", "num_requests": "--requests", "num_heads": "--heads",
          "row_format": "--format", "device_buffer_size": "--buffer", "host_block_size": "--block-size",
          "cache_kernels": "--kernels"}
# CUDA graphs capture the step, so they need unchecked mode (no host reads of device values)
_GRAPH_SWITCHES = {"graphs": "--graphs", "layer_graphs": "--layer-graphs"}


class FormerSpelling(argparse.Action):
    """A flag's former spelling: hidden from ``--help``, it sets the flag's ``dest`` and
    leaves a note in ``namespace.notes``, which the command prints on stderr once its
    arguments are accepted (an error stays one line)."""

    def __init__(self, option_strings, dest, *, use: str, **kw):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kw)
        self.use = use

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        notes = getattr(namespace, "notes", None) or []
        notes.append(f"{option_string} is deprecated and will be removed; {self.use}")
        namespace.notes = notes


# what each sized field means, in the help text
_HELP = {
    "num_layers": "decoder layers", "num_heads": "attention heads", "hidden": "model width",
    "indexer_dim": "indexer query/key width", "vocab": "vocabulary size", "top_k": "indexer top-k K",
    "num_requests": "requests in the workload", "min_prompt": "shortest prompt, tokens",
    "max_prompt": "longest prompt, tokens", "min_decode": "fewest decode tokens per request",
    "max_decode": "most decode tokens per request", "arrival_every": "request i arrives at step i x this",
    "query_len": "decode tokens per request and step (MTP > 1)", "chunk": "prefill chunk per request and step",
    "max_batch_tokens": "tokens per step, prefill and decode together",
    "device_buffer_size": "hisparse hot LRU slots S per (layer, request)",
    "host_block_size": "tokens per host block", "max_num_reqs": "request slots of both caches",
    "row_format": "KV row format", "device": "cpu, cuda or cuda:N", "seed": "seed of weights and workload",
    "locality": "0..1: how alike consecutive indexer queries are (higher: more hot-row reuse)",
    "synthetic_context": "the first N positions of every prompt are written as random rows instead of "
                         "prefilled (long contexts in seconds)",
    "backend": "attention backend for the decode (refused, not replaced, when it can't run here)",
    "flashmla_lib": "path of FlashMLA's _flashmla_C library",
    "cache_kernels": "hisparse cache kernels (triton on CPU needs TRITON_INTERPRET=1)",
    "overlap": "hisparse decode: miss copy before attention, or beside the hit attention",
    "tolerance": "max |resident - hisparse| output difference, relative to max |output|",
    "ffn": "rest-of-layer stand-in after attention", "ffn_intermediate": "MLP / per-expert intermediate size",
    "ffn_experts": "MoE: experts", "ffn_active": "MoE: experts per token", "ffn_shared": "MoE: shared experts",
    "shared_prefix": "request i's prompt starts with the tokens of group i %% --prefix-groups's prefix of this "
                     "length (with --prefix-reuse, hisparse computes them once)",
    "prefix_groups": "groups of requests sharing a prefix (with --shared-prefix)",
    "ffn_routing": "MoE: choose a token's experts from its hidden state (content) or its input embedding "
                   "(token: rounding-level differences can't reroute it, for output comparisons)",
}

# what a field's None default stands for, in the help text
_NONE_MEANS = {"device_buffer_size": "2 x top-k", "max_num_reqs": "--requests",
               "backend": "the attention chooser's pick for the device",
               "flashmla_lib": "FlashMLA from an installed vllm or sgl_kernel"}


# the cache config's fields that a flag sets under another name, for error messages
CONFIG_FLAGS = {"max_query_len": "--query-len"}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or OneLineParser(
        prog="hisparse mini-engine",
        description="Serve a random-weight sparse-MLA model with a resident KV cache and with hisparse; "
                    "check the outputs match and compare speed.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="base sizes (flags override)")
    for f in dataclasses.fields(MiniEngineConfig):
        name = f.name
        if name == "validate":
            g = p.add_mutually_exclusive_group()
            g.add_argument("--unchecked", dest="validate", action="store_false", default=None,
                           help="skip host-syncing validation in the hot loop (--graphs and --layer-graphs "
                                "choose it themselves)")
            g.add_argument("--checked", dest="validate", action="store_true", default=None,
                           help="validate in the hot loop (the default; next to --graphs or --layer-graphs, "
                                "which need unchecked mode, it is refused)")
            continue
        if name in _SWITCHES:
            flag, action, text = _SWITCHES[name]
            p.add_argument(flag, dest=name, action=action, default=None, help=text)
            continue
        if name == "index_correlation":
            p.add_argument("--index-correlation", dest="index_correlation", type=float, default=None,
                           metavar="A", help="0 <= A < 1: the Full layers' indexers share a common part with "
                                             "weight A, so adjacent layers select overlapping positions "
                                             "(default 0: independent)")
            continue
        if name == "device_pool_rows":  # a new field: spelled as stress, plan and autotune spell it, no former name
            p.add_argument("--pool-rows", dest="device_pool_rows", type=rows_arg, default=None, metavar="N",
                           help="hisparse: device rows per layer shared by all requests, hot buffers included (the "
                                "elastic tier: requests resident in pages of 64 rows until a spill demotes them) "
                                "(default none)")
            continue
        if name == "index_share":
            p.add_argument("--index-share", dest="index_share", type=int, default=None, metavar="N",
                           help="layers per indexer: layer l runs one iff l %% N == 0, the next N - 1 "
                                "reuse its top-k (IndexCache-style Full / Shared layers) (default 1)")
            continue
        ann = str(f.type)
        typ = str if name in _CHOICES else float if "float" in ann else int if "int" in ann else str
        default = f.default.value if isinstance(f.default, enum.Enum) else f.default
        field_flag = "--" + name.replace("_", "-")
        flag = _FLAGS.get(name, field_flag)
        meta = None if name in _CHOICES else flag[2:].upper().replace("-", "_")
        p.add_argument(flag, dest=name, type=typ, default=None, choices=_CHOICES.get(name), metavar=meta,
                       help=f"{_HELP.get(name, '')} (default {_NONE_MEANS.get(name, default)})".strip())
        if flag != field_flag:
            p.add_argument(field_flag, dest=name, type=typ, default=None, choices=_CHOICES.get(name),
                           action=FormerSpelling, use=f"use {flag} (the same option)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    p.add_argument("--out", default=None, type=path_arg, metavar="FILE", help="also write the JSON result to this file")
    p.add_argument("--quiet", action="store_true",
                   help="no progress output on stderr (shown by default when stderr is a terminal)")
    p.add_argument("--progress", dest="progress", action=FormerSpelling, nargs=0, const=True, default=False,
                   use="progress shows by default when stderr is a terminal, and --quiet turns it off")
    p.add_argument("--record", default=None, type=path_arg, metavar="FILE",
                   help="write the decode steps' top-k (the real indexer's) to a .npz trace; "
                        "replay it with `hisparse stress --replay FILE` (needs --query-len 1)")
    return p


def config_from_args(args: argparse.Namespace, notes: list[str] | None = None) -> MiniEngineConfig:
    """The config of the preset and the flags given. ``--graphs`` / ``--layer-graphs``
    choose unchecked mode unless ``--checked`` is given (then refused); ``notes`` (when
    given) gets a line saying so."""
    kw = dict(PRESETS[args.preset])
    for f in dataclasses.fields(MiniEngineConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            kw[f.name] = v
    graphs = [flag for name, flag in _GRAPH_SWITCHES.items() if kw.get(name)]
    if graphs and kw.get("validate", True):
        if getattr(args, "validate", None) is True:
            raise ValueError(f"{' and '.join(graphs)} need{'s' if len(graphs) == 1 else ''} unchecked mode and "
                             "--checked asks for checked mode, "
                             "which reads device values on the host, as a captured CUDA graph cannot: "
                             "drop --checked (or " + " and ".join(graphs) + ")")
        kw["validate"] = False
        if notes is not None:
            notes.append(f"{' and '.join(graphs)}: running unchecked (as --unchecked does), which CUDA graphs "
                         "need: checked mode reads device values on the host, as a captured graph cannot")
    return MiniEngineConfig(**kw)


def _progress(args: argparse.Namespace) -> bool:
    """Progress on stderr: on a terminal unless --quiet; --progress (deprecated) forces it."""
    if args.progress and args.quiet:
        raise ValueError("--progress (deprecated) and --quiet contradict each other; give --quiet alone, or "
                         "neither (progress shows when stderr is a terminal)")
    return bool(args.progress) or (not args.quiet and sys.stderr.isatty())


def run_args(args: argparse.Namespace) -> int:
    """Run from parsed arguments; prints the report; exit status 1 when outputs differ."""
    with Outputs() as outs:
        return _run(args, outs)


def _run(args: argparse.Namespace, outs: Outputs) -> int:
    outs.file(args.out, flag="--out")
    outs.file(args.record, flag="--record")
    notes = list(getattr(args, "notes", None) or [])
    cfg = config_from_args(args, notes)
    check_mini_engine(args, cfg)
    progress = _progress(args)
    for note in notes:
        print(f"hisparse mini-engine: note: {note}", file=sys.stderr)
    from .loop import run  # the engine itself (cache, kernels): loaded when a run starts

    res = run(cfg, progress=progress, record=args.record, outputs=outs)
    print(json.dumps(res, indent=2) if args.json else format_report(res))
    if args.out:
        with writing("--out", args.out), outs.open(args.out) as fh:
            fh.write(json.dumps(res, indent=2).encode())
    return EXIT_OK if res["compare"]["within_tolerance"] else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """``python -m hisparse_tools.mini_engine``: the same as ``hisparse mini-engine``."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    return run_command("mini-engine", lambda: run_args(args), flags={**flag_names(parser), **CONFIG_FLAGS})


__all__ = ["CONFIG_FLAGS", "build_parser", "config_from_args", "run_args", "main"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
