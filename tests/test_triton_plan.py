"""Planned decode calls of the Triton backend (``attention.triton_plan``), in the
interpreter: an unchecked backend reuses the plan of a call with the same metadata
(``call_signature``) and gives the same bits as a checked backend; a call whose
metadata differs in anything the checks or the plan read is checked and planned anew,
and a bad one fails exactly as it does without plans."""

import math

import pytest
import torch

from hisparse.attention import triton_plan as TP
from hisparse.attention.triton_backend import TritonBackend, TritonMLAConfig
from hisparse.formats import quantize_fp8_ds_mla_reference

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SCALE = 1.0 / math.sqrt(576)
CFG = TritonMLAConfig(block_h=16, block_n=16, num_warps=4)  # small tiles: the interpreter is slow


def _problem(T=3, H=5, K=20, N=40, fmt="fp8_ds_mla", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 576, generator=g).bfloat16()
    rows = quantize_fp8_ds_mla_reference(x) if fmt == "fp8_ds_mla" else x
    q = torch.randn(T, H, 576, generator=g).bfloat16()
    idx = torch.randint(-1, N, (T, K), generator=g, dtype=torch.int32)
    vc = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
    return q.to(DEV), rows.to(DEV), idx.to(DEV), vc.to(DEV)


class _Counting:
    """Counts the plans made (monkeypatched over DecodePlan.__init__)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = TP.DecodePlan.__init__

        def init(plan, *a, **kw):
            self.n += 1
            real(plan, *a, **kw)
        monkeypatch.setattr(TP.DecodePlan, "__init__", init)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16", "bf16_bytes"])
def test_unchecked_calls_reuse_their_plan_and_match_the_checked_backend(fmt, monkeypatch):
    plans = _Counting(monkeypatch)
    q, rows, idx, vc = _problem(fmt="bf16" if fmt == "bf16_bytes" else fmt)
    if fmt == "bf16_bytes":
        rows = rows.view(torch.uint8)  # [N, 1152] bytes of bf16 rows: viewed back per call
    rf = "fp8_ds_mla" if fmt == "fp8_ds_mla" else "bf16"
    checked = TritonBackend(config=CFG, allow_interpreter=True)
    fast = TritonBackend(config=CFG, allow_interpreter=True, validate=False)
    for v in (None, vc):
        want = checked.decode(q, rows, idx, valid_counts=v, sm_scale=SCALE, row_format=rf)
        made = plans.n
        for _ in range(3):
            got = fast.decode(q, rows, idx, valid_counts=v, sm_scale=SCALE, row_format=rf)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert plans.n == made + 1  # the first unchecked call planned; the others reused it
    # new contents with the same metadata: the same plan, the new values
    q2, _, idx2, _ = _problem(fmt="bf16" if fmt == "bf16_bytes" else fmt, seed=5)
    made = plans.n
    got = fast.decode(q2, rows, idx2, sm_scale=SCALE, row_format=rf)
    want = checked.decode(q2, rows, idx2, sm_scale=SCALE, row_format=rf)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and plans.n == made + 1  # (the checked one)


def test_other_metadata_is_planned_anew(monkeypatch):
    plans = _Counting(monkeypatch)
    q, rows, idx, vc = _problem(T=4)
    be = TritonBackend(config=CFG, allow_interpreter=True, validate=False)
    be.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    spare = torch.empty(rows.numel() + 16, dtype=torch.uint8, device=DEV)
    shifted = spare[4:4 + rows.numel()].view(rows.shape)  # 4-byte aligned, not 16
    shifted.copy_(rows)
    wide_q = torch.empty(4, 5, 640, dtype=torch.bfloat16, device=DEV)[:, :, :576]
    wide_q.copy_(q)
    variants = [
        dict(q=q[:3], indices=idx[:3]),  # fewer tokens
        dict(indices=idx[:, :17].contiguous()),  # another K
        dict(kv_rows=torch.cat([rows, rows[:10]])),  # more rows (N is a kernel argument)
        dict(kv_rows=shifted),  # another alignment
        dict(q=wide_q),  # other strides
        dict(valid_counts=vc),
        dict(sm_scale=SCALE * 2),  # the scale is an argument, not part of the plan: no new plan
        dict(sms=8),  # an SM budget: checked, planned anew (ignored on CPU)
    ]
    base = dict(q=q, kv_rows=rows, indices=idx, valid_counts=None, sm_scale=SCALE, sms=None)
    for i, change in enumerate(variants):
        args = {**base, **change}
        made = plans.n
        out, lse = be.decode(args["q"], args["kv_rows"], args["indices"], valid_counts=args["valid_counts"],
                             sm_scale=args["sm_scale"], row_format="fp8_ds_mla", sms=args["sms"])
        want = TritonBackend(config=CFG, allow_interpreter=True).decode(
            args["q"], args["kv_rows"], args["indices"], valid_counts=args["valid_counts"],
            sm_scale=args["sm_scale"], row_format="fp8_ds_mla")
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), change
        same = "sm_scale" in change
        assert plans.n == made + (1 if same else 2), (i, change)  # + 1: the checked backend's own
        if "sms" in change:
            again = be.decode(args["q"], args["kv_rows"], args["indices"], sm_scale=SCALE, row_format="fp8_ds_mla",
                              sms=8)
            assert plans.n == made + 2 and torch.equal(again[0], out)
    # another config on the same backend: planned anew
    made = plans.n
    be.config = TritonMLAConfig(block_h=16, block_n=32, num_warps=4)
    be.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    assert plans.n == made + 1


def test_bad_calls_fail_as_without_plans():
    """A call differing from a planned one in a way the checks refuse gets the checks'
    error (the plan is never used for it), and the planned call works afterwards."""
    q, rows, idx, vc = _problem()
    be = TritonBackend(config=CFG, allow_interpreter=True, validate=False)
    want = be.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    bad = [
        (dict(q=q.float()), TypeError, "q must be bfloat16"),
        (dict(indices=idx.long()), TypeError, "indices must be int32"),
        (dict(indices=idx[:2]), ValueError, "indices must be"),
        (dict(kv_rows=rows[:, :600]), ValueError, "fp8_ds_mla kv_rows must be"),
        (dict(valid_counts=vc[:2]), ValueError, "valid_counts must be"),
        (dict(sm_scale=float("nan")), ValueError, "sm_scale"),
        (dict(sm_scale=0.0), ValueError, "sm_scale"),
        (dict(sm_scale=True), TypeError, "sm_scale"),
        (dict(sms=0), ValueError, "sms"),
        (dict(sms=True), TypeError, "sms"),
        (dict(row_format="fp9"), ValueError, "fp9"),
        (dict(q=q.to_sparse()), (RuntimeError, TypeError, ValueError), None),
    ]
    for change, exc, match in bad:
        args = {**dict(q=q, kv_rows=rows, indices=idx, valid_counts=None, sm_scale=SCALE, row_format="fp8_ds_mla",
                       sms=None), **change}
        with pytest.raises(exc, match=match):
            TritonBackend(config=CFG, allow_interpreter=True, validate=False).decode(
                args["q"], args["kv_rows"], args["indices"], valid_counts=args["valid_counts"],
                sm_scale=args["sm_scale"], row_format=args["row_format"], sms=args["sms"])
        with pytest.raises(exc, match=match):
            be.decode(args["q"], args["kv_rows"], args["indices"], valid_counts=args["valid_counts"],
                      sm_scale=args["sm_scale"], row_format=args["row_format"], sms=args["sms"])
    got = be.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_signature_reads_every_field_the_checks_read():
    """Tensors differing only in one field the checks or the plan read have different
    signatures; other kinds of call have none (checked every time)."""
    q, rows, idx, vc = _problem()
    sig = lambda **kw: TP.call_signature(*[kw.get(n, d) for n, d in (  # noqa: E731
        ("q", q), ("kv", rows), ("idx", idx), ("vc", None), ("scale", SCALE), ("fmt", "fp8_ds_mla"), ("sms", None))])
    base = sig()
    assert base is not None and base == sig()
    flat = torch.zeros(rows.numel() + 16, dtype=torch.uint8, device=DEV)
    others = [sig(q=q.clone()[:, :, :].contiguous().view(q.shape)) == base,  # the same metadata: equal
              sig(q=q.transpose(0, 1).contiguous().transpose(0, 1)) == base,
              sig(kv=flat[2:2 + rows.numel()].view(rows.shape)) == base,
              sig(kv=flat[16:16 + rows.numel()].view(rows.shape)) == base,
              sig(idx=idx.long()) == base,
              sig(vc=vc) == base,
              sig(fmt="bf16") == base,
              sig(sms=8) == base]
    assert others == [True, False, False, True, False, False, False, False]
    assert sig(scale=1) is None and sig(scale=float("inf")) is None and sig(scale=-1.0) is None
    assert sig(sms=True) is None and sig(fmt=["fp8_ds_mla"]) is None
    assert sig(q=torch.nn.Parameter(q.float(), requires_grad=False)) is None  # a subclass
    assert sig(q=q.to_sparse()) is None


@pytest.mark.parametrize("validate", [True, False])
def test_outputs_given_are_written_in_place_with_the_same_bits(validate, monkeypatch):
    """``decode(..., out=, lse=)``: the results land in the caller's buffers, which are
    returned, bit for bit those of a call that allocates; one of the two may be given
    alone; unchecked, calls with and without outputs keep plans of their own, and a new
    pair of buffers of the same metadata reuses the plan. A split (combine) plan and an
    empty top-k write the given buffers too."""
    plans = _Counting(monkeypatch)
    q, rows, idx, vc = _problem(T=4)
    be = TritonBackend(config=CFG, allow_interpreter=True, validate=validate)
    for cfg_be in (be, TritonBackend(config=TritonMLAConfig(block_h=16, block_n=16, num_warps=4, num_splits=2),
                                     allow_interpreter=True, validate=validate)):
        want = cfg_be.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE, row_format="fp8_ds_mla")
        for _ in range(2):
            out = torch.full((4, 5, 512), 7.0, dtype=torch.bfloat16, device=DEV)
            lse = torch.full((4, 5), 7.0, dtype=torch.float32, device=DEV)
            got = cfg_be.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE, row_format="fp8_ds_mla",
                                out=out, lse=lse)
            assert got[0] is out and got[1] is lse
            assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        o_only = torch.empty((4, 5, 512), dtype=torch.bfloat16, device=DEV)
        got = cfg_be.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE, row_format="fp8_ds_mla", out=o_only)
        assert got[0] is o_only and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if not validate:
        made = plans.n
        be.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE, row_format="fp8_ds_mla",
                  out=torch.empty((4, 5, 512), dtype=torch.bfloat16, device=DEV),
                  lse=torch.empty((4, 5), dtype=torch.float32, device=DEV))
        assert plans.n == made  # the plan of the first call with both outputs
    out = torch.full((4, 5, 512), 7.0, dtype=torch.bfloat16, device=DEV)
    lse = torch.full((4, 5), 7.0, dtype=torch.float32, device=DEV)
    empty_k = idx[:, :0]
    be.decode(q, rows, empty_k, sm_scale=SCALE, row_format="fp8_ds_mla", out=out, lse=lse)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("validate", [True, False])
def test_bad_outputs_are_refused_before_any_launch(validate):
    """Outputs of the wrong dtype, shape, layout or type, or sharing storage with an
    input or with each other: a clear error, nothing written (the buffers keep their
    contents), and the next good call runs. Unchecked, the storage check is the
    caller's promise; the rest is checked whenever a call's output metadata is new."""
    q, rows, idx, _ = _problem(T=4)
    be = TritonBackend(config=CFG, allow_interpreter=True, validate=validate)
    kw = dict(sm_scale=SCALE, row_format="fp8_ds_mla")
    good_o = torch.full((4, 5, 512), 3.0, dtype=torch.bfloat16, device=DEV)
    good_l = torch.full((4, 5), 3.0, dtype=torch.float32, device=DEV)
    big = torch.zeros((4, 5, 1024), dtype=torch.bfloat16, device=DEV)
    bad = [
        (dict(out=good_o.float()), ValueError, "out must be torch.bfloat16"),
        (dict(out=good_o[:3]), ValueError, r"out must be torch.bfloat16 \[4, 5, 512\]"),
        (dict(lse=good_l.double()), ValueError, "lse must be torch.float32"),
        (dict(out=big[:, :, :512]), ValueError, "out must be contiguous"),
        (dict(out=good_o, lse=good_l.t().contiguous().t()), ValueError, "lse must be"),
        (dict(out="buffer"), TypeError, "out must be a torch.Tensor"),
    ]
    if validate:
        alias = torch.empty(4 * 5 * 576 * 2, dtype=torch.bfloat16, device=DEV)
        q2 = alias[:4 * 5 * 576].view(4, 5, 576)
        q2.copy_(q)
        bad += [
            (dict(q=q2, out=alias[4 * 5 * 576:4 * 5 * 576 + 4 * 5 * 512].view(4, 5, 512)), ValueError,
             "out shares storage"),
            (dict(out=good_o, lse=good_o.view(torch.float32).view(-1)[:20].view(4, 5)), ValueError,
             "lse shares storage"),
        ]
    for extra, err, msg in bad:
        call = dict(kw)
        qq = extra.pop("q", q)
        call.update(extra)
        with pytest.raises(err, match=msg):
            be.decode(qq, rows, idx, **call)
        assert bool((good_o == 3.0).all()) and bool((good_l == 3.0).all())
    got = be.decode(q, rows, idx, out=good_o, lse=good_l, **kw)
    assert got[0] is good_o and not bool((good_o == 3.0).all())
