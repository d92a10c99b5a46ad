"""Run the Triton sparse-MLA decode a few times at one shape, for a profiler to attach to.

    ncu --kernel-name regex:sparse_mla_decode --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python3 -m benchmarks.profile_decode

Shape: T tokens, H heads, K = 2048 random rows out of T x 4096, fp8_ds_mla (default) or bf16.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from benchmarks import common
from hisparse.attention import TritonBackend, TritonMLAConfig
from hisparse.formats import quantize_fp8_ds_mla


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pos = common.positive_int
    ap.add_argument("--T", type=pos, default=64)
    ap.add_argument("--H", type=pos, default=128)
    ap.add_argument("--K", type=pos, default=2048)
    ap.add_argument("--format", default="fp8_ds_mla", choices=["fp8_ds_mla", "bf16"])
    ap.add_argument("--shape", help="BH,BN,W,S[,ISO[,SPLITS[,PF[,WIDE]]]] launch shape "
                                    "(default: default_config)")
    ap.add_argument("--ws", metavar="BN,STAGES,RAW[,PREG]",
                    help="profile the warp-specialised Gluon kernel with this ring shape")
    ap.add_argument("--calls", type=pos, default=4)
    a = ap.parse_args(argv)
    cfg = None
    try:  # a bad launch shape is the user's mistake: say so before looking for a GPU
        if a.shape:
            v = [int(s) for s in a.shape.split(",")]
            cfg = TritonMLAConfig(block_h=v[0], block_n=v[1], num_warps=v[2], num_stages=v[3],
                                  isolate_qk=bool(v[4]) if len(v) > 4 else False,
                                  num_splits=v[5] if len(v) > 5 else None,
                                  prefetch=v[6] if len(v) > 6 else 0,
                                  wide=bool(v[7]) if len(v) > 7 else False)
        if a.ws:
            v = [int(s) for s in a.ws.split(",")]
            cfg = TritonMLAConfig(block_h=64, block_n=v[0], num_warps=4, num_stages=v[1], ws=True,
                                  ws_raw=v[2], ws_producer_regs=v[3] if len(v) > 3 else 56)
    except IndexError:
        ap.error(f"--ws {a.ws}: expected BN,STAGES,RAW[,PREG]" if a.ws else
                 f"--shape {a.shape}: expected BH,BN,W,S[,ISO[,SPLITS[,PF[,WIDE]]]]")
    except (ValueError, TypeError) as e:
        ap.error(f"--ws {a.ws}: {e}" if a.ws else f"--shape {a.shape}: {e}")
    if not torch.cuda.is_available():
        print("profile_decode: no CUDA device; it runs the Triton decode kernel on a GPU for a "
              "profiler (ncu) to attach to", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    N = a.T * 4096
    x = torch.randn(N, 576, device="cuda", generator=g).bfloat16()
    rows = quantize_fp8_ds_mla(x) if a.format == "fp8_ds_mla" else x
    q = torch.randn(a.T, a.H, 576, device="cuda", generator=g).bfloat16()
    idx = torch.randint(0, N, (a.T, a.K), device="cuda", generator=g, dtype=torch.int32)
    be = TritonBackend(config=cfg, validate=False)
    for _ in range(a.calls):
        be.decode(q, rows, idx, sm_scale=1.0 / math.sqrt(576), row_format=a.format)
    torch.cuda.synchronize()
    print("done", a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
