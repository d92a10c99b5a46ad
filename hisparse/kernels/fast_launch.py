"""Launching compiled Triton kernels without the JIT's per-call work.

``kernel[grid](*args, **kwargs)`` on a ``@triton.jit`` function binds the arguments,
specialises every one (dtype, 16-byte alignment of pointers, ``== 1`` and ``% 16`` of
integers), builds a cache key, looks the compiled kernel up and only then calls its
launcher: tens of microseconds of host time per launch, several launches per decode
layer. ``FastKernel(kernel)[grid](*args, **kwargs)`` takes the same call and, once the
JIT has compiled and launched it for a specialisation, calls that compiled kernel's
launcher directly for every later call of the same specialisation.

The guard: a call's key here is a refinement of the JIT's specialisation -- for every
argument its class (tensor: dtype and ``data_ptr() % 16 == 0``; int: ``== 1``, ``% 16
== 0`` and its integer width, whether or not the parameter is specialised; bool,
float, None), the constexpr values and launch options as given, the current device and
Triton's debug / instrumentation settings -- so two calls with equal keys here have
equal keys in the JIT, and a call whose key is new (an unaligned pointer, another
dtype, a new constexpr) takes the JIT path, which compiles if needed, and is
remembered. ``tests/test_fast_launch.py`` checks the refinement against the installed
Triton's own binder.

The direct path is on only where every condition holds, else each call takes the JIT
path (``fast_launch_problem()`` says why; logged once):
- a CUDA launch (not the interpreter) on a Triton whose launcher call was tested here
  (``TESTED_TRITON``: the compiled kernel's ``run(grid x, y, z, stream, function,
  packed metadata, launch metadata, enter hook, exit hook, *every argument)``, and for a
  ``BoundLaunch`` the C function under it, ``_c_launch``);
- no launch hooks set (a profiler's ``knobs.runtime.launch_enter_hook``) and no pre-run
  hooks on the kernel: those calls take the JIT path, which runs them;
- ``HISPARSE_FAST_LAUNCH`` not set to 0 (``set_direct_launch(False)`` turns it off in a
  running process: benchmarks compare the two paths in one run).
"""

from __future__ import annotations

import functools
import logging
import os
import types
import weakref

import torch
import triton

try:
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
except ImportError:  # an older Triton: fast_launch_problem() says so and nothing uses these
    _knobs = _driver = None

_LOG = logging.getLogger("hisparse.fast_launch")

# (major, minor) of the Triton releases whose compiled-kernel launcher call was tested on a GPU
TESTED_TRITON = ((3, 6),)


def _version() -> tuple[int, int]:
    parts = triton.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


_OFF: list = []  # non-empty: set_direct_launch(False)


def set_direct_launch(on: bool) -> bool:
    """Allow (True) or forbid (False) direct launches from now on; returns the previous
    setting. A switch for benchmarks and tests that compare the two paths in one
    process; the conditions of ``fast_launch_problem`` still apply."""
    previous = not _OFF
    _OFF.clear()
    if not on:
        _OFF.append(True)
    return previous


def fast_launch_problem() -> str | None:
    """None when compiled kernels may be launched directly in this process, else why
    not (one line)."""
    return "set_direct_launch(False)" if _OFF else _static_problem()


@functools.lru_cache(maxsize=None)
def _static_problem() -> str | None:
    if os.environ.get("HISPARSE_FAST_LAUNCH", "1") == "0":
        return "HISPARSE_FAST_LAUNCH=0"
    if _knobs is None:
        return f"triton {triton.__version__} has no triton.knobs"
    if _knobs.runtime.interpret:
        return "Triton's interpreter (TRITON_INTERPRET=1) runs the kernels"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if _version() not in TESTED_TRITON:
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TRITON)
        return f"triton {triton.__version__}'s launcher call is not tested here (tested: {tested})"
    return None


_MISSING = object()
_I32 = 1 << 31
_I64 = 1 << 63


def arg_class(a: object, _tensor=torch.Tensor, _int=int, _lo=-_I32, _hi=_I32) -> object:
    """A non-constexpr argument's class (see the module docstring): equal classes are
    specialised alike by the JIT. Tensors: (dtype, 16-byte aligned); ints: a string
    naming the width (i32 / i64 / u64) and whether the value is 1 or a multiple of 16;
    bools and None: themselves; floats: "f". (The keyword defaults are constants bound
    once: this runs for every argument of every launch.)"""
    t = type(a)
    if t is _int:
        if _lo <= a < _hi:
            return "i1" if a == 1 else "i" if a & 15 else "i16"
        if -_I64 <= a < _I64:
            return "l" if a & 15 else "l16"
        if _I64 <= a < 2 * _I64:
            return "u" if a & 15 else "u16"
        raise _Unclassified  # no integer type holds it: the JIT refuses it
    if t is _tensor:
        return a.dtype, not a.data_ptr() & 15
    if t is bool or a is None:
        return a
    if t is float:
        return "f"
    dtype = getattr(a, "dtype", None)  # a tensor subclass, or another object with a pointer
    if dtype is not None and hasattr(a, "data_ptr"):
        return dtype, not a.data_ptr() & 15
    raise _Unclassified


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton keeps an empty chain of hooks (a profiler
    adds to it) or, in some releases, None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


class _Unclassified(Exception):
    """An argument this module does not classify: the call takes the JIT path."""


class FastKernel:
    """``kernel`` (a ``@triton.jit`` / ``@gluon.jit`` function) launched directly once
    compiled for a call's specialisation: ``FastKernel(k)[grid](*args, **kwargs)`` is
    ``k[grid](*args, **kwargs)``. ``hits`` / ``misses``: calls launched directly / through the
    JIT (``unkeyed``: of the misses, those with an argument of no known class)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.hits = 0
        self.misses = 0
        self.unkeyed = 0  # calls with an argument this module does not classify (each took the JIT path)
        self._compiled: dict = {}
        self._plans: dict = {}  # call shape -> _Plan (None: such calls do not bind)
        params = getattr(kernel, "params", None)  # None: the interpreter's function
        if params is None:
            self._names, self._const, self._defaults = None, (), {}
            return
        self._names = [p.name for p in params]
        self._index = {n: i for i, n in enumerate(self._names)}
        self._const = tuple(bool(p.is_constexpr) for p in params)
        self._defaults = {p.name: p.default for p in params if p.has_default}

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def bind(self, grid: tuple, kwargs: dict) -> "BoundLaunch":
        """``kernel[grid](*args, **kwargs)`` with this grid (a tuple) and these keyword
        arguments fixed, for a caller that knows its positional arguments' classes
        from checks of its own: see ``BoundLaunch``."""
        return BoundLaunch(self, grid, kwargs)

    def _globals_changed(self) -> bool:
        """Whether a global the kernel read when compiled has another value now (the JIT's
        own check, which then raises)."""
        for (name, _), (val, globals_dict) in self.kernel.used_global_vals.items():
            if globals_dict.get(name, _MISSING) != val:
                return True
        return False

    def _plan(self, shape: tuple) -> "_Plan | None":
        """How calls of one shape -- (number of positional arguments, keyword names in
        order) -- are keyed and bound; None when such a call does not bind (the JIT path
        says what is wrong)."""
        n, kw = shape[0], shape[1:]
        names, const = self._names, self._const
        if n > len(names) or len(set(kw)) != len(kw) or any(k in self._index and self._index[k] < n for k in kw):
            return None
        tail = []
        for name in names[n:]:
            if name in kw:
                tail.append((name, True, None))
            elif name in self._defaults:
                tail.append((name, False, self._defaults[name]))
            else:
                return None
        pos_const = const[:n]
        kw_kind = tuple(k in self._index and not const[self._index[k]] for k in kw)  # True: classify it
        return _Plan(not any(pos_const), pos_const, not any(kw_kind), kw_kind, tuple(tail))

    def _key(self, plan: "_Plan", shape: tuple, args: tuple, kwargs: dict, dev) -> tuple:
        """A call's key, a refinement of the JIT's specialisation of it: the shape, each
        positional argument's class (its value for a constexpr), each keyword value with
        its type (its class for a parameter that is not constexpr), the device and
        Triton's debug and instrumentation settings."""
        if plan.pos_plain:
            pk = tuple(map(arg_class, args))
        else:
            pk = tuple(a if c else arg_class(a) for a, c in zip(args, plan.pos_const))
        kv = tuple(kwargs.values())
        if plan.kw_plain:
            kk = (kv, tuple(map(type, kv)))
        else:
            kk = tuple(arg_class(v) if k else (type(v), v) for v, k in zip(kv, plan.kw_kind))
        rt = _knobs.runtime
        return (shape, pk, kk, dev, rt.debug, _knobs.compilation.instrumentation_mode)

    def _launch(self, grid, *args, **kwargs):
        kernel = self.kernel
        if self._names is None or fast_launch_problem() is not None or callable(grid):
            self.misses += 1
            return kernel[grid](*args, **kwargs)
        rt = _knobs.runtime
        hooked = _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook) or bool(kernel.pre_run_hooks)
        shape = (len(args), *kwargs)
        plan = self._plans.get(shape, _MISSING)
        if plan is _MISSING:
            plan = self._plans[shape] = self._plan(shape)
        key = None
        if plan is not None:
            dev = _driver.active.get_current_device()
            try:
                key = self._key(plan, shape, args, kwargs, dev)
                hash(key)  # an unhashable constexpr or option: the JIT path
            except (_Unclassified, TypeError):
                key = None
        if key is None:
            self.unkeyed += 1
        compiled = None if key is None or hooked else self._compiled.get(key)
        if compiled is not None and self._globals_changed():
            compiled = None  # the JIT raises for a changed global a kernel read
        if compiled is None:
            self.misses += 1
            compiled = kernel[grid](*args, **kwargs)
            if key is not None and not hooked and compiled is not None and hasattr(compiled, "packed_metadata"):
                self._compiled[key] = compiled
            return compiled
        self.hits += 1
        n = len(grid)
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                     _driver.active.get_current_stream(dev), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *[kwargs[name] if given else d for name, given, d in plan.tail])
        return compiled


class BoundLaunch:
    """``FastKernel.bind``'s answer: ``bound(key, *args)`` is ``kernel[grid](*args,
    **kwargs)`` with the bound grid and keyword arguments. The caller's promise: two
    calls of one ``BoundLaunch`` with equal ``key`` (hashable) have positional arguments of
    equal classes (``arg_class``) and equal values where the parameter is a constexpr --
    typically a plan made once for a call's checked metadata, whose key is what it does
    not fix (the alignment of buffers it allocates per call). The first call of a key
    goes through ``FastKernel`` (its own key, the JIT where needed) and remembers the
    compiled kernel; later calls of the key launch it directly, with no per-argument
    work, under the same conditions as ``FastKernel``'s direct path (no launch or
    pre-run hook, no changed global, the same device and debug / instrumentation
    settings as when it was remembered), else through ``FastKernel`` again.

    ``bound.ready(key)`` is that direct launch (a ``DirectLaunch``) when it may run now,
    else None: a caller that checks it may pass each pointer as its address (an int,
    ``tensor.data_ptr()``), which the launcher takes as it is -- no ``data_ptr`` call and
    no driver query of the pointer per argument."""

    __slots__ = ("_fk", "grid", "kwargs", "_grid3", "_compiled")

    def __init__(self, fk: FastKernel, grid: tuple, kwargs: dict) -> None:
        self._fk, self.grid, self.kwargs = fk, tuple(grid), dict(kwargs)
        g = self.grid
        self._grid3 = (g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)
        self._compiled: dict = {}  # key -> DirectLaunch

    def ready(self, key) -> "DirectLaunch | None":
        """The remembered direct launch of ``key`` if every condition of the direct path
        holds now, else None (the call must go through ``bound(key, *tensors)``)."""
        d = self._compiled.get(key)
        if d is None or fast_launch_problem() is not None:
            return None
        rt = _knobs.runtime
        fk = self._fk
        if (_hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook) or fk.kernel.pre_run_hooks
                or (rt.debug, _knobs.compilation.instrumentation_mode) != d.knob
                or _driver.active.get_current_device() != d.dev or fk._globals_changed()):
            return None
        return d

    def __call__(self, key, *args):
        d = self.ready(key)
        if d is not None:
            d(*args)
            return d.compiled
        fk = self._fk
        compiled = fk._launch(self.grid, *args, **self.kwargs)
        if (key is not None and fast_launch_problem() is None and hasattr(compiled, "packed_metadata")
                and not fk.kernel.pre_run_hooks):
            plan = fk._plans.get((len(args), *self.kwargs))
            if plan is not None:
                kw = self.kwargs
                rt = _knobs.runtime
                self._compiled[key] = DirectLaunch(
                    fk, compiled, self._grid3, _driver.active.get_current_device(),
                    (rt.debug, _knobs.compilation.instrumentation_mode),
                    tuple(kw[name] if given else d for name, given, d in plan.tail))
        return compiled


def _c_launch(launcher):
    """The C launch function under a compiled kernel's launcher object, when calling it
    directly is the launcher's own call (``CudaLauncher.__call__`` of the tested Triton:
    no global or profile scratch to allocate, no tensor-descriptor wrapper); else None."""
    fn = getattr(launcher, "launch", None)
    if (type(launcher).__name__ != "CudaLauncher" or not isinstance(fn, types.BuiltinFunctionType)
            or getattr(launcher, "global_scratch_size", 1) != 0 or getattr(launcher, "profile_scratch_size", 1) != 0
            or not hasattr(launcher, "launch_cooperative_grid") or not hasattr(launcher, "launch_pdl")):
        return None
    return fn


class DirectLaunch:
    """One remembered compiled kernel of a ``BoundLaunch`` key: ``d(*args)`` launches it on
    the current stream with the bound grid, ``args`` (tensors, or pointers as ints) and
    the bound constexprs -- through the launcher's C function where ``_c_launch`` allows,
    else through the launcher object."""

    __slots__ = ("fk", "compiled", "grid", "dev", "knob", "tail", "_c", "_c_head", "_head")

    def __init__(self, fk: FastKernel, compiled, grid: tuple, dev, knob: tuple, tail: tuple) -> None:
        self.fk, self.compiled, self.grid, self.dev, self.knob, self.tail = fk, compiled, grid, dev, knob, tail
        run = compiled.run
        self._c = _c_launch(run)
        if self._c is not None:  # (coop, pdl, global scratch, profile scratch, metadata, launch metadata, hooks)
            self._c_head = (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
                            None, None, None)
        self._head = (compiled.packed_metadata, None, None, None)

    def __call__(self, *args) -> None:
        self.fk.hits += 1
        g0, g1, g2 = self.grid
        c = self.compiled
        stream = _driver.active.get_current_stream(self.dev)
        if self._c is not None:
            self._c(g0, g1, g2, stream, c.function, *self._c_head, *args, *self.tail)
        else:
            c.run(g0, g1, g2, stream, c.function, *self._head, *args, *self.tail)


class _Plan:
    """``FastKernel._plan``'s answer for one call shape."""

    __slots__ = ("pos_plain", "pos_const", "kw_plain", "kw_kind", "tail")

    def __init__(self, pos_plain, pos_const, kw_plain, kw_kind, tail) -> None:
        self.pos_plain, self.pos_const, self.kw_plain, self.kw_kind, self.tail = (
            pos_plain, pos_const, kw_plain, kw_kind, tail)


_FAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOGGED: list = []


def fast(kernel) -> FastKernel:
    """The process's ``FastKernel`` of ``kernel`` (made on first use, dropped with the
    kernel; an object that is not a JIT function, e.g. an instrumented stand-in, is
    launched through its own ``[grid]`` every call)."""
    try:
        f = _FAST.get(kernel)
    except TypeError:  # not weakly referenceable / hashable: a new wrapper each call
        return FastKernel(kernel)
    if f is None:
        f = _FAST[kernel] = FastKernel(kernel)
        why = fast_launch_problem()
        if why is not None and not _LOGGED:
            _LOGGED.append(why)
            _LOG.info("compiled Triton kernels launch through the JIT: %s", why)
    return f


def direct_launch_counts() -> dict[str, dict[str, int]]:
    """Per kernel launched through ``fast`` so far in this process: {"direct": calls
    launched directly, "jit": calls through Triton's JIT}."""
    out: dict[str, dict[str, int]] = {}
    for f in list(_FAST.values()):
        name = getattr(f.kernel, "__name__", None) or type(f.kernel).__name__
        c = out.setdefault(name, {"direct": 0, "jit": 0})
        c["direct"] += f.hits
        c["jit"] += f.misses
    return out


__all__ = ["BoundLaunch", "DirectLaunch", "FastKernel", "direct_launch_counts", "TESTED_TRITON", "arg_class", "fast", "fast_launch_problem", "set_direct_launch"]
