"""One rule for every subcommand's options: an option that would do nothing is refused.

The rule (``hisparse --help`` and every command's ``--help`` end with it):

- An option **given on the command line** that has no effect given the others (it
  configures a feature the others leave off, or one the device does not have) is
  refused: a ``ValueError`` (exit 2) naming the option, what it needs, and what to do.
  Restating a default (``--format fp8_ds_mla``) is not refused: it is what runs.
- A file an option reads (``--flashmla-lib``, ``--replay``) must exist (exit 2).

"Given" means typed by the user: these checks read the parsed arguments, whose
defaults for the options concerned are ``None`` (or ``False`` for a switch), so a value
a preset or default supplies is never refused. A command calls its check right after
parsing, before any work; the stress checks that need a replayed trace's sizes are in
:mod:`hisparse_tools.stress_limits`.
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

import torch

RULE = ("an option that has no effect given the others is refused (exit 2),\n"
        "and so is a file an option reads that does not exist")

STRESS_METRICS_EVERY = 10  # --metrics-every when not given
STRESS_METRICS_ADDR = "127.0.0.1"  # --metrics-addr when not given


def unused(flags: Sequence[str], why: str, fix: str) -> ValueError:
    """The error of options that would do nothing: ``{flags} ha(s/ve) no effect {why}; {fix}``."""
    names = ", ".join(flags)
    return ValueError(f"{names} {'has' if len(flags) == 1 else 'have'} no effect {why}; {fix}")


def existing_file(flag: str, path: str | None) -> None:
    """A file an option reads must exist (a typo would otherwise be ignored or read late)."""
    if path is not None and not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise ValueError(f"{flag} {path!r} {what}; give the path of an existing file or leave {flag} out")


def _flashmla_lib(args: argparse.Namespace, *, device: str | None) -> None:
    """``--flashmla-lib``: the file exists, and the FlashMLA backend may run: not another
    backend named with ``--backend``, not a CPU device (FlashMLA runs on CUDA only)."""
    lib = getattr(args, "flashmla_lib", None)
    if lib is None:
        return
    existing_file("--flashmla-lib", lib)
    backend = getattr(args, "backend", None)
    if backend is not None and backend != "flashmla":
        raise unused(["--flashmla-lib"], f"with --backend {backend} (it loads the FlashMLA backend)",
                     "drop it, or use --backend flashmla")
    if backend is None and device == "cpu":
        raise unused(["--flashmla-lib"], "on a CPU device (FlashMLA runs on CUDA only)",
                     "drop it, or use --device cuda")


def check_stress(args: argparse.Namespace) -> None:
    """``hisparse stress``: metrics options without the output they configure; ``--ramp``
    without ``--pool-rows`` (the pool it overflows), or next to what it replaces
    (``--steps``, ``--churn``: the ramp sets its own schedule; ``--replay``);
    ``--prefix-groups`` without ``--shared-prefix``, which makes its own requests (so not
    next to ``--ramp`` or ``--replay``); then the defaults those options stand for are
    filled in."""
    if args.ramp and args.pool_rows is None:
        raise unused(["--ramp"], "without --pool-rows (it adds requests until that device pool overflows)",
                     "add --pool-rows N or drop it")
    if args.ramp:
        given = [flag for dest, flag in (("steps", "--steps"), ("churn", "--churn"))
                 if getattr(args, dest) is not None]
        if given:
            raise unused(given, "with --ramp (the ramp sets the schedule: a join per step until the pool "
                                "overflows, then a leave per step until none is left)",
                         f"drop {'it' if len(given) == 1 else 'them'}, or drop --ramp")
        if args.replay is not None:
            raise ValueError("--ramp makes its own join/leave schedule and --replay FILE replays a recorded one: "
                             "give one of them")
    if args.prefix_groups is not None and args.shared_prefix is None:
        raise unused(["--prefix-groups"], "without --shared-prefix (it sets how many groups share a prefix)",
                     "add --shared-prefix P or drop it")
    if args.shared_prefix is not None and (args.ramp or args.replay is not None):
        other = "--ramp" if args.ramp else "--replay FILE"
        raise ValueError(f"--shared-prefix makes its own requests (prompts sharing a prefix, follow-up turns) and "
                         f"{other} {'makes' if args.ramp else 'replays'} another schedule: give one of them")
    if args.metrics_every is not None and not args.metrics_file:
        raise unused(["--metrics-every"], "without --metrics-file (it sets how often that file is rewritten)",
                     "add --metrics-file FILE or drop it")
    if args.metrics_addr is not None and args.metrics_port is None:
        raise unused(["--metrics-addr"], "without --metrics-port (it is the address that port listens on)",
                     "add --metrics-port PORT or drop it")
    if args.metrics_every is None:
        args.metrics_every = STRESS_METRICS_EVERY
    if args.metrics_addr is None:
        args.metrics_addr = STRESS_METRICS_ADDR


def check_plan(args: argparse.Namespace) -> None:
    """``hisparse plan``: ``--tp-share`` needs more than one rank; ``--prefix-groups``
    needs ``--shared-prefix``."""
    if args.tp_share and args.tp_ranks == 1:
        raise unused(["--tp-share"], "with --tp 1 (one rank keeps one host pool, shared or not)",
                     "give --tp N with N > 1, or drop it")
    if args.prefix_groups is not None and args.shared_prefix is None:
        raise unused(["--prefix-groups"], "without --shared-prefix (it sets how many groups share a prefix)",
                     "add --shared-prefix P or drop it")


def check_autotune(args: argparse.Namespace) -> None:
    """``hisparse autotune``: ``--flashmla-lib`` (see :func:`_flashmla_lib`)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _flashmla_lib(args, device="cpu" if device == "cpu" else "cuda")


def check_env(args: argparse.Namespace) -> None:
    """``hisparse env``: a ``--flashmla-lib`` to try must exist."""
    existing_file("--flashmla-lib", args.flashmla_lib)


def check_whatif(args: argparse.Namespace) -> None:
    """``hisparse whatif``: ``--row-bytes`` sets the row size, so ``--format`` would not."""
    if args.row_bytes is not None and args.row_format is not None:
        raise unused(["--format"], "with --row-bytes (which sets the row size itself)", "give one of the two")


# mini-engine: options that size the rest-of-layer stand-in, by the --ffn kinds they apply to
_FFN_OPTIONS = {"ffn_intermediate": ("--ffn-intermediate", ("mlp", "moe")),
                "ffn_experts": ("--ffn-experts", ("moe",)), "ffn_active": ("--ffn-active", ("moe",)),
                "ffn_shared": ("--ffn-shared", ("moe",)), "ffn_routing": ("--ffn-routing", ("moe",))}


def check_mini_engine(args: argparse.Namespace, cfg) -> None:
    """``hisparse mini-engine`` (``cfg``: the MiniEngineConfig built from ``args``): FFN
    sizes of a kind not asked for, ``--sync-steps`` or ``--flashmla-lib`` on a CPU
    device, a missing ``--flashmla-lib`` file."""
    dead = [flag for name, (flag, kinds) in _FFN_OPTIONS.items()
            if getattr(args, name, None) is not None and cfg.ffn.value not in kinds]
    if dead:
        need = "--ffn moe" if "--ffn-intermediate" not in dead else "--ffn mlp or --ffn moe"
        default = "" if getattr(args, "ffn", None) is not None else " (the default)"
        them = "them" if len(dead) > 1 else "it"
        what = "they configure" if len(dead) > 1 else "it configures"
        raise unused(dead, f"with --ffn {cfg.ffn.value}{default}: {what} the stand-in of {need}",
                     f"add {need}, or drop {them}")
    cpu = not cfg.device.startswith("cuda")
    if getattr(args, "async_steps", None) is False and cpu:
        raise unused(["--sync-steps"], "on a CPU device (a CPU step has finished when its calls return, so "
                                       "no step runs ahead)", "drop it, or use --device cuda")
    _flashmla_lib(args, device="cpu" if cpu else "cuda")


__all__ = ["RULE", "unused", "existing_file", "check_stress", "check_plan", "check_autotune", "check_env",
           "check_whatif", "check_mini_engine"]
