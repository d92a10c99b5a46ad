"""The direct launch of compiled Triton kernels (``hisparse.kernels.fast_launch``), on CPU:

- its guard: two calls with equal keys here are specialised alike by the installed
  Triton's own binder (built for an sm90 target, no GPU needed), for every kernel the
  package launches through it, over arguments of every class; and a guard that ignored
  alignment or integer width would be caught by the same check;
- binding (positional, keyword, defaults, launch options) and the JIT fallbacks;
- when the direct path is off, and why.

The launches themselves are checked on a GPU (``tests/test_fast_launch_gpu.py``).
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch
import triton

from hisparse.kernels import fast_launch as FL

def _ws_kernels():
    from hisparse.kernels.gluon_support import gluon_ws_problem
    return [] if gluon_ws_problem() else [("hisparse.kernels.mla_decode_ws", "sparse_mla_decode_ws_kernel")]


KERNELS = [
    ("hisparse.kernels.resolve", "resolve_kernel"),
    ("hisparse.kernels.resolve_resident", "resolve_resident_kernel"),
    ("hisparse.kernels.resolve_lookup", "resolve_lookup_kernel"),
    ("hisparse.kernels.mla_decode", "sparse_mla_decode_kernel"),
    ("hisparse.kernels.mla_decode", "sparse_mla_combine_kernel"),
    ("hisparse.kernels.mla_decode_wide", "sparse_mla_decode_wide_kernel"),
    ("hisparse.kernels.mla_miss", "miss_split_kernel"),
    ("hisparse.kernels.mla_miss", "miss_combine_kernel"),
    ("hisparse.kernels.mla_miss", "miss_merge_kernel"),
    ("hisparse.kernels.convert", "convert_topk_kernel"),
    ("hisparse.kernels.apply_write", "apply_write_plan_kernel"),
    ("hisparse.kernels.apply_write", "apply_write_layers_kernel"),
    ("hisparse.kernels.copy_rows", "copy_rows_kernel"),
    ("hisparse.kernels.copy_rows", "copy_staged_kernel"),
    ("hisparse.kernels.stage_prefill", "stage_copy_kernel"),
    ("hisparse.kernels.stage_prefill", "stage_dequant_kernel"),
    ("hisparse.kernels.quant", "quantize_fp8_ds_mla_kernel"),
    *_ws_kernels(),
]


def _jit_function(kernel):
    """The JITFunction of ``kernel`` (under the interpreter, one made from the same
    function and decorator arguments)."""
    from triton.runtime.jit import JITFunction
    if isinstance(kernel, JITFunction):
        return kernel
    kw = {k: v for k, v in kernel.kwargs.items()
          if k in ("version", "do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline",
                   "repr", "launch_metadata")}
    return JITFunction(kernel.fn, **kw)


def _binder(jf):
    """The installed Triton's binder of ``jf`` for an sm90 CUDA target (no driver needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    return create_function_from_signature(jf.signature, jf.params, make_backend(GPUTarget("cuda", 90, 32)))


def _product_key(fk: FL.FastKernel, jf, values: list, options: dict) -> tuple:
    """The key ``FastKernel`` computes for a call of ``values`` (every parameter, in
    order) made as hisparse's call sites make them: the parameters before the first
    constexpr positionally, the rest (and the launch ``options``) by keyword."""
    const = [p.is_constexpr for p in jf.params]
    n = const.index(True) if True in const else len(const)
    args = tuple(values[:n])
    kwargs = {p.name: v for p, v in zip(jf.params[n:], values[n:])}
    kwargs.update(options)
    shape = (len(args), *kwargs)
    plan = fk._plan(shape)
    assert plan is not None
    return fk._key(plan, shape, args, kwargs, 0)




def _tensor(dtype, aligned: bool, rng: random.Random) -> torch.Tensor:
    """A tensor of ``dtype`` whose data_ptr is 16-byte aligned or not (offsets vary)."""
    buf = torch.zeros(256, dtype=torch.uint8)
    assert buf.data_ptr() % 16 == 0
    itemsize = torch.empty(0, dtype=dtype).element_size()
    off = rng.choice([0, 16, 32, 64]) if aligned else rng.choice([o for o in (1, 2, 4, 8, 12, 20) if o % itemsize == 0])
    return buf[off:off + 64].view(dtype)


# members of one class each (arg_class equal within a list, different between lists)
_INT_CLASSES = [
    [1],
    [0, 16, 32, -16, 1 << 30, -(1 << 31)],
    [2, 17, -1, (1 << 31) - 1, 3, -(1 << 31) + 1],
    [1 << 31, 1 << 32, -(1 << 31) - 16, -(1 << 63)],
    [(1 << 31) + 1, (1 << 40) + 3, (1 << 63) - 1, -(1 << 63) + 1],
    [1 << 63, (1 << 63) + 16, (1 << 64) - 16],
    [(1 << 63) + 1, (1 << 63) + 3, (1 << 64) - 1],
]
_DTYPES = [torch.int32, torch.int64, torch.uint8, torch.bfloat16, torch.float32]


def _draw_class(rng: random.Random):
    """A random argument class: ('int', i) / ('t', dtype, aligned) / ('f',) / ('b', v) / ('n',)."""
    r = rng.random()
    if r < 0.45:
        return ("int", rng.randrange(len(_INT_CLASSES)))
    if r < 0.85:
        return ("t", rng.choice(_DTYPES), rng.random() < 0.6)
    if r < 0.92:
        return ("f",)
    if r < 0.97:
        return ("b", rng.random() < 0.5)
    return ("n",)


def _member(cls, rng: random.Random):
    kind = cls[0]
    if kind == "int":
        return rng.choice(_INT_CLASSES[cls[1]])
    if kind == "t":
        return _tensor(cls[1], cls[2], rng)
    if kind == "f":
        return rng.choice([0.5, 1.0, 3.25, -2.0, 0.0])
    if kind == "b":
        return cls[1]
    return None


def _const_value(p, rng: random.Random | None = None):
    if p.has_default:
        return p.default
    return 2 if rng is None else rng.choice([2, 3, 16, False])  # no 1 beside True: equal keys in both


@pytest.mark.parametrize("module,name", KERNELS)
def test_key_refines_tritons_specialization(module, name):
    """Over random argument classes, constexpr values and warps: any two calls whose keys
    here are equal get the same specialisation from Triton's binder, so a compiled kernel
    launched directly is the one the JIT would have picked (the other direction, keys
    that separate what the binder separates, is the next test's)."""
    kernel = getattr(importlib.import_module(module), name)
    jf = _jit_function(kernel)
    binder = _binder(jf)
    fk = FL.FastKernel(jf)
    const = tuple(p.is_constexpr for p in jf.params)
    rng = random.Random(hash(name) & 0xFFFF)
    seen: dict = {}
    for _ in range(60):
        classes = [None if c else _draw_class(rng) for c in const]
        consts = [_const_value(p, rng) if c else None for p, c in zip(jf.params, const)]
        warps = rng.choice([4, 8])
        for _rep in range(2):  # two members of the same classes
            values = [consts[i] if c else _member(k, rng) for i, (c, k) in enumerate(zip(const, classes))]
            key = _product_key(fk, jf, values, {"num_warps": warps})
            _, spec, _ = binder(*values, num_warps=warps)
            spec = repr(spec)
            assert seen.setdefault(key, spec) == spec, (name, key)
    assert len(seen) > 30  # the draws covered many classes


def test_a_coarser_key_would_be_caught(monkeypatch):
    """The check above is not vacuous: keys that ignore pointer alignment, or an
    integer's divisibility, give two calls one key where Triton's binder gives them two
    specialisations (calls that differ only there)."""
    from hisparse.kernels.copy_rows import copy_rows_kernel
    jf = _jit_function(copy_rows_kernel)
    binder = _binder(jf)
    fk = FL.FastKernel(jf)
    const = tuple(p.is_constexpr for p in jf.params)
    real = FL.arg_class

    def coarse_tensor(a):
        c = real(a)
        return c[0] if isinstance(c, tuple) and isinstance(c[0], torch.dtype) else c

    def coarse_int(a):
        c = real(a)
        return c[:1] if type(a) is int else c

    rng = random.Random(7)
    base = [_const_value(p) if c else _tensor(torch.int32, True, rng) for p, c in zip(jf.params, const)]
    unaligned = [v if c else _tensor(torch.int32, False, rng) for v, c in zip(base, const)]
    ints16 = [v if c else 32 for v, c in zip(base, const)]
    ints3 = [v if c else 3 for v, c in zip(base, const)]
    for coarse, a, b in ((coarse_tensor, base, unaligned), (coarse_int, ints16, ints3)):
        assert _product_key(fk, jf, a, {}) != _product_key(fk, jf, b, {})  # the real keys separate them
        assert repr(binder(*a)[1]) != repr(binder(*b)[1])  # as Triton does
        monkeypatch.setattr(FL, "arg_class", coarse)
        assert _product_key(fk, jf, a, {}) == _product_key(fk, jf, b, {}), coarse.__name__  # a coarse key would not
        monkeypatch.setattr(FL, "arg_class", real)


def test_arg_classes():
    assert FL.arg_class(1) != FL.arg_class(2) != FL.arg_class(16)
    assert FL.arg_class(16) == FL.arg_class(32) and FL.arg_class(3) == FL.arg_class(5)
    assert FL.arg_class(16) != FL.arg_class(1 << 32) != FL.arg_class(1 << 63)
    assert FL.arg_class(True) != FL.arg_class(1) and FL.arg_class(False) != FL.arg_class(0)
    assert FL.arg_class(None) is None and FL.arg_class(0.5) == FL.arg_class(2.0)
    t = torch.zeros(8, dtype=torch.int32)
    assert FL.arg_class(t) == (torch.int32, True) and FL.arg_class(t[1:]) == (torch.int32, False)
    assert FL.arg_class(-(1 << 31)) == FL.arg_class(0) and FL.arg_class((1 << 64) - 1) == "u"
    assert FL.arg_class(1) != FL.arg_class(True)  # a bool is its own class, not the int 1
    for too_big in (1 << 64, -(1 << 63) - 1):  # no integer type holds them: the JIT refuses them
        with pytest.raises(FL._Unclassified):
            FL.arg_class(too_big)
    with pytest.raises(FL._Unclassified):
        FL.arg_class("x")
    with pytest.raises(FL._Unclassified):
        FL.arg_class(torch.tensor(1).numpy())  # a numpy scalar: the JIT path decides


class _FakeParam:
    def __init__(self, name, constexpr=False, default=None, has_default=False):
        self.name, self.is_constexpr, self.default, self.has_default = name, constexpr, default, has_default


class _FakeKernel:
    """Stands in for a JIT function: records calls through ``[grid]``."""

    pre_run_hooks: list = []

    def __init__(self):
        self.params = [_FakeParam("x"), _FakeParam("n"), _FakeParam("B", True),
                       _FakeParam("D", True, default=3, has_default=True)]
        self.calls = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return None  # not a compiled kernel: never remembered
        return call


def test_plans_bind_arguments_by_call_shape():
    """A call shape (positional count, keyword names) maps to how its values are bound:
    the parameters after the positional ones from the keywords or their defaults; a
    shape that does not bind (a parameter missing, given twice, too many) has no plan."""
    fk = FL.FastKernel(_FakeKernel())
    plan = fk._plan((2, "B", "num_warps", "num_stages"))
    assert plan.tail == (("B", True, None), ("D", False, 3)) and plan.pos_plain and plan.kw_plain
    plan = fk._plan((1, "n", "B", "D"))
    assert plan.tail == (("n", True, None), ("B", True, None), ("D", True, None)) and plan.kw_kind == (True, False, False)
    assert fk._plan((1, "B")) is None  # n missing
    assert fk._plan((5,)) is None  # too many
    assert fk._plan((2, "x", "B")) is None  # x given twice
    assert not fk._plan((3, "num_warps")).pos_plain  # B (a constexpr) given positionally: keyed by value


def test_calls_go_through_the_jit_when_not_compiled_or_off(monkeypatch):
    """Under the interpreter (this suite) the direct path is off and says why; every
    call is the kernel's own ``[grid]`` call, arguments unchanged."""
    why = FL.fast_launch_problem()
    assert why is not None and ("interpreter" in why or "tested" in why or "HISPARSE_FAST_LAUNCH" in why)
    k = _FakeKernel()
    fk = FL.FastKernel(k)
    t = torch.zeros(4, dtype=torch.int32)
    fk[(2, 1)](t, 5, B=8, num_warps=4)
    fk[(3,)](t, 6, B=8)
    assert [c[0] for c in k.calls] == [(2, 1), (3,)] and k.calls[0][1] == (t, 5)
    assert k.calls[0][2] == {"B": 8, "num_warps": 4}
    assert fk.hits == 0 and fk.misses == 2
    assert FL.fast(k) is FL.fast(k) and FL.fast(k).kernel is k


def test_problem_names_the_reason(monkeypatch):
    FL._static_problem.cache_clear()
    try:
        monkeypatch.setenv("HISPARSE_FAST_LAUNCH", "0")
        assert FL.fast_launch_problem() == "HISPARSE_FAST_LAUNCH=0"
        FL._static_problem.cache_clear()
        monkeypatch.delenv("HISPARSE_FAST_LAUNCH")
        from triton import knobs
        monkeypatch.setattr(knobs.runtime, "interpret", False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(triton, "__version__", "3.99.0")
        why = FL.fast_launch_problem()
        assert "3.99.0" in why and "not tested" in why
        FL._static_problem.cache_clear()
        monkeypatch.setattr(triton, "__version__", "3.6.0")
        assert FL.fast_launch_problem() is None
        assert FL.set_direct_launch(False) is True
        assert FL.fast_launch_problem() == "set_direct_launch(False)"
        assert FL.set_direct_launch(True) is False and FL.fast_launch_problem() is None
    finally:
        monkeypatch.undo()
        FL._static_problem.cache_clear()


def test_kernels_launch_through_fast_under_the_interpreter():
    """A real kernel through ``fast()`` under the interpreter: the JIT path, the result
    of a plain launch (the copy kernel's rows, byte-exact)."""
    from hisparse.cache.transfer import copy_rows
    src = torch.randint(0, 255, (37, 656), dtype=torch.uint8)
    dst = torch.zeros(41, 656, dtype=torch.uint8)
    s = torch.tensor([3, 0, 36, 5], dtype=torch.int32)
    d = torch.tensor([40, 1, 2, 7], dtype=torch.int32)
    copy_rows(src, s, dst, d)
    assert torch.equal(dst[d.long()], src[s.long()])


class _FakeCompiled:
    """What the JIT returns for a launch: records direct launches."""

    function = "fn-handle"
    packed_metadata = ("meta",)

    def __init__(self):
        self.direct = []

    def run(self, *args):
        self.direct.append(args)


class _CompilingKernel(_FakeKernel):
    """A JIT function stand-in whose ``[grid]`` call compiles (once per call here) and
    returns the compiled kernel, as ``JITFunction.run`` does."""

    def __init__(self):
        super().__init__()
        self.used_global_vals = {}
        self.pre_run_hooks = []
        self.compiled = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            c = _FakeCompiled()
            self.compiled.append(c)
            return c
        return call


class _FakeDriverActive:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


def test_direct_path_launches_the_compiled_kernel(monkeypatch):
    """With the direct path on (a fake driver: no GPU here): the first call of a
    specialisation goes through the JIT, later ones call the compiled kernel's launcher
    with (grid x, y, z, stream, function, packed metadata, None, None, None, every
    argument in order, constexprs and defaults included); a new class of argument, a
    new constexpr or option, a set launch hook, a pre-run hook, Triton's debug knob or a
    changed global read by the kernel each take the JIT path."""
    from triton import knobs
    monkeypatch.setattr(FL, "fast_launch_problem", lambda: None)
    monkeypatch.setattr(FL, "_driver", type("D", (), {"active": _FakeDriverActive()})())
    k = _CompilingKernel()
    fk = FL.FastKernel(k)
    t = torch.zeros(8, dtype=torch.int32)
    fk[(5, 2)](t, 7, B=4, num_warps=4)  # compiles
    assert fk.misses == 1 and fk.hits == 0 and len(k.compiled) == 1
    fk[(6,)](t, 23, B=4, num_warps=4)  # 23: same class as 7
    assert fk.hits == 1
    assert k.compiled[0].direct == [(6, 1, 1, 1234, "fn-handle", ("meta",), None, None, None, t, 23, 4, 3)]
    for args, kw in (((t[1:], 7), {"B": 4, "num_warps": 4}),  # unaligned pointer
                     ((t, 16), {"B": 4, "num_warps": 4}),  # n % 16 == 0
                     ((t, 7), {"B": 5, "num_warps": 4}),  # constexpr
                     ((t, 7), {"B": 4, "num_warps": 8}),  # option
                     ((t, 7), {"B": 4, "D": 9, "num_warps": 4})):  # a defaulted constexpr given
        before = fk.misses
        fk[(1,)](*args, **kw)
        assert fk.misses == before + 1, (args, kw)
        fk[(1,)](*args, **kw)
        assert fk.misses == before + 1 and fk.hits >= 2, (args, kw)  # then direct
    hits = fk.hits
    knobs.runtime.launch_enter_hook.add(print)
    try:
        fk[(1,)](t, 7, B=4, num_warps=4)
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
    assert fk.hits == hits
    k.pre_run_hooks.append(lambda *a, **kw: None)
    fk[(1,)](t, 7, B=4, num_warps=4)
    k.pre_run_hooks.clear()
    assert fk.hits == hits
    monkeypatch.setattr(knobs.runtime, "debug", True)
    fk[(1,)](t, 7, B=4, num_warps=4)
    monkeypatch.setattr(knobs.runtime, "debug", False)
    assert fk.hits == hits
    g = {"X": 1}
    k.used_global_vals = {("X", 0): (1, g)}
    fk[(1,)](t, 7, B=4, num_warps=4)
    assert fk.hits == hits + 1
    g["X"] = 2  # the JIT would raise: the direct path must not launch the stale kernel
    fk[(1,)](t, 7, B=4, num_warps=4)
    assert fk.hits == hits + 1
    before = fk.unkeyed
    fk[(1,)](t, 1 << 70, B=4)  # no integer type holds it
    assert fk.unkeyed == before + 1


def test_bound_launch_remembers_the_compiled_kernel_per_key(monkeypatch):
    """``FastKernel.bind``: the first call of a key goes through ``FastKernel`` (the JIT
    here); later calls of that key call the compiled kernel's launcher with the bound
    grid, every positional argument and the constexprs in parameter order; a new key, a
    launch hook, Triton's debug knob, another current device or ``set_direct_launch(False)``
    each take ``FastKernel``'s path."""
    from triton import knobs
    monkeypatch.setattr(FL, "fast_launch_problem", lambda: None)
    driver = _FakeDriverActive()
    monkeypatch.setattr(FL, "_driver", type("D", (), {"active": driver})())
    k = _CompilingKernel()
    fk = FL.FastKernel(k)
    bound = fk.bind((5, 2), {"B": 4, "num_warps": 4})
    t = torch.zeros(8, dtype=torch.int32)
    bound("a", t, 7)
    assert fk.misses == 1 and len(k.compiled) == 1 and k.calls[-1] == ((5, 2), (t, 7), {"B": 4, "num_warps": 4})
    bound("a", t, 9)  # the caller's promise: same key, same classes
    assert fk.hits == 1 and k.compiled[0].direct == [(5, 2, 1, 1234, "fn-handle", ("meta",), None, None, None, t, 9, 4, 3)]
    bound("b", t, 7)  # a new key: FastKernel's own key finds the compiled kernel
    assert fk.hits == 2 and len(k.compiled) == 1
    bound("b", t, 7)
    assert fk.hits == 3
    misses = fk.misses
    knobs.runtime.launch_enter_hook.add(print)
    try:
        bound("a", t, 7)
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
    monkeypatch.setattr(knobs.runtime, "debug", True)
    bound("a", t, 7)
    monkeypatch.setattr(knobs.runtime, "debug", False)
    assert fk.misses == misses + 2
    bound("a", t, 7)  # the debug launch was remembered under "a": FastKernel's direct path, remembered again
    hits = fk.hits
    bound("a", t, 7)
    assert fk.hits == hits + 1 and fk.misses == misses + 2  # direct again
    monkeypatch.setattr(driver, "get_current_device", lambda: 1)
    bound("a", t, 7)
    monkeypatch.setattr(driver, "get_current_device", lambda: 0)
    assert fk.misses == misses + 3
    bound("a", t, 7)  # remembered for device 1 last: FastKernel's path finds device 0's kernel
    bound("a", t, 7)
    hits = fk.hits
    k.pre_run_hooks.append(lambda *a, **kw: None)
    bound("a", t, 7)
    k.pre_run_hooks.clear()
    assert fk.hits == hits
    g = {"X": 1}
    k.used_global_vals = {("X", 0): (1, g)}
    bound("a", t, 7)
    assert fk.hits == hits + 1
    g["X"] = 2  # the JIT would raise: the stale kernel is not launched directly
    misses = fk.misses
    bound("a", t, 7)
    assert fk.hits == hits + 1 and fk.misses == misses + 1
    k.used_global_vals = {}
    misses = fk.misses
    hits = fk.hits
    FL.set_direct_launch(False)
    monkeypatch.setattr(FL, "fast_launch_problem", lambda: "set_direct_launch(False)")
    try:
        bound("a", t, 7)
    finally:
        FL.set_direct_launch(True)
    assert fk.hits == hits and fk.misses == misses + 1



class CudaLauncher:
    """Stands in for Triton 3.6's launcher object (its class name is what ``_c_launch``
    checks): a C ``launch`` function (``print`` here: a builtin taking any arguments),
    its scratch sizes and launch flags; its own call records its arguments."""

    def __init__(self, scratch=0):
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True
        self.launch = print
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def test_direct_launch_calls_the_c_launch_function_when_the_launcher_allows(monkeypatch, capsys):
    """``DirectLaunch``: under Triton 3.6's ``CudaLauncher`` with no scratch, a direct launch
    calls its C ``launch`` with (grid, stream, function, cooperative, pdl, no scratch,
    packed metadata, no launch metadata, no hooks, every argument, the bound constexprs);
    a launcher with scratch to allocate, or whose ``launch`` is no builtin, is called as
    an object (its ``__call__`` allocates the scratch). Pointers given as ints pass as
    they are."""
    monkeypatch.setattr(FL, "_driver", type("D", (), {"active": _FakeDriverActive()})())
    fk = FL.FastKernel(_CompilingKernel())

    def direct(launcher):
        compiled = type("C", (), {"function": "fn-handle", "packed_metadata": ("meta",), "run": launcher})()
        return FL.DirectLaunch(fk, compiled, (5, 2, 1), 0, (False, None), (4, 3))

    plain = CudaLauncher()
    assert FL._c_launch(plain) is print
    direct(plain)(0xABC0, 7)
    assert capsys.readouterr().out.split() == [
        "5", "2", "1", "1234", "fn-handle", "False", "True", "None", "None", "('meta',)", "None", "None", "None",
        str(0xABC0), "7", "4", "3"]
    assert plain.calls == []
    for launcher in (CudaLauncher(scratch=64), CudaLauncher()):
        if launcher.global_scratch_size == 0:
            launcher.launch = lambda *a: None  # not a builtin
        assert FL._c_launch(launcher) is None
        direct(launcher)(0xABC0, 7)
        assert launcher.calls == [(5, 2, 1, 1234, "fn-handle", ("meta",), None, None, None, 0xABC0, 7, 4, 3)]
    other = type("OtherLauncher", (CudaLauncher,), {})()  # another class: the object path
    assert FL._c_launch(other) is None
    assert capsys.readouterr().out == "" and fk.hits == 3
