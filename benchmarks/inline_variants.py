"""Inline decode (host misses read by the ws kernel) with other ring / producer-register shapes and L2 prefetch of the host lines."""
import argparse, dataclasses, json, math, sys
import torch
from benchmarks import bench_layer as BL, common
from hisparse.attention.triton_backend import TritonBackend, default_config
from hisparse.decode import DecodeLayer
from hisparse.formats import RowFormat

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--hits", type=int, nargs="+", default=[100, 95, 90])
ap.add_argument("--out")
x = ap.parse_args()
a = BL.parse_args(["--batch", str(x.batch), "--reps", "20"])
dev = torch.device("cuda")
s = BL.Setup(x.batch, a.context, a, dev)
H = 128
base = default_config(x.batch, 128, 2048, dev, "fp8_ds_mla")
from hisparse.attention import triton_backend as TB
variants = {}
for pf in (0, 1, 2):
    variants[f"pf{pf}"] = (base, pf)
    variants[f"pf{pf}_preg88"] = (dataclasses.replace(base, ws_producer_regs=88), pf)
rep = {"env": common.environment(dev), "cases": []}
sm = 1 / math.sqrt(576)
for h in x.hits:
    g = torch.Generator().manual_seed(h)
    q = (torch.randn((s.B, H, 576), generator=g) * 0.5).to(device=dev, dtype=torch.bfloat16)
    tk = s.topk(h / 100, 1)
    rbe = TritonBackend(validate=False)
    res, ref = BL.timed(lambda: rbe.decode(q, s.resident[0], s.resident_idx(tk), sm_scale=sm, row_format=RowFormat.FP8_DS_MLA), s, a, restore=False)
    row = {"hit": h, "resident": res}
    line = f"hit {h}%: resident {res['median_us']:.1f} us"
    for name, (cfg, pf) in variants.items():
        TB._HOST_PREFETCH[0] = pf
        be = TritonBackend(validate=False, config=cfg)
        dl = DecodeLayer(s.cache, be, overlap="inline")
        try:
            r, out = BL.timed(lambda: dl(0, s.req, tk, q, sm_scale=sm), s, a, restore=True)
        except Exception as e:  # scratch: report and go on
            row[name] = {"error": repr(e)[:300]}; line += f" | {name} ERR {e!r:.80}"; continue
        r["ratio"] = r["median_us"] / res["median_us"]
        r["max_rel_diff"] = BL.max_diff(out, ref)
        row[name] = r
        line += f" | {name} {r['ratio']:.3f}x ({r['median_us']:.1f}, diff {r['max_rel_diff']:.1e})"
        if pf == 0:  # the resident kernel with the same ring, for reference
            rr, _ = BL.timed(lambda: be.decode(q, s.resident[0], s.resident_idx(tk), sm_scale=sm, row_format=RowFormat.FP8_DS_MLA), s, a, restore=False)
            row[name + "_resident"] = rr
            line += f" [res {rr['median_us']:.1f}]"
    # resolve alone (serial resolve, no copy) for the inline budget
    mr = torch.empty((s.B, 2048), dtype=torch.int32, device=dev)
    c = s.cache
    def resolve_only():
        out = c._bufs[0].view(s.B, 2048)
        c.stager.resolve_fn(c.state, 0, s.req, tk, out, max_query_len=1, compact=False, miss_rows=mr)
    r, _ = BL.timed(resolve_only, s, a, restore=True)
    row["resolve_only"] = r
    line += f" | resolve alone {r['median_us']:.1f} us"
    print(line, flush=True)
    rep["cases"].append(row)
if x.out:
    json.dump(rep, open(x.out, "w"), indent=1)
