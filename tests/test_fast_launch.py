"""FastLaunch: Triton launches through the compiled launcher once a specialisation was
seen (CPU: a stand-in JIT function records what the launcher is called with)."""

from __future__ import annotations

import types

import pytest
import torch
from triton import knobs

from hisparse.kernels import launch as L


class FakeCompiled:
    def __init__(self, name):
        self.name, self.function, self.packed_metadata = name, f"fn-{name}", f"md-{name}"
        self.calls, self.meta_calls = [], []

    def run(self, *a):
        self.calls.append(a)

    def launch_metadata(self, grid, stream, *vals):
        self.meta_calls.append((grid, stream, vals))
        return {"name": self.name}


class FakeJIT:
    """A JIT function whose specialisation of each argument is (type, x == 1)."""

    def __init__(self):
        self.device_caches = {}
        self.jit_calls = []
        self.kernels = {}

    def _bind(self, *args, C=0, **opts):
        params = {f"a{i}": a for i, a in enumerate(args)}
        params["C"] = C
        return params, [(type(a).__name__, a == 1) for a in args] + [("constexpr", C)], opts

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.jit_calls.append((grid, args, kw))
            self.device_caches[0] = (None, None, None, None, self._bind)
            spec = tuple(self._bind(*args, **kw)[1])
            return self.kernels.setdefault(spec, FakeCompiled(f"k{len(self.kernels)}"))
        return launch


@pytest.fixture
def cuda_stub(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: types.SimpleNamespace(cuda_stream=77))
    monkeypatch.setattr(L, "interpreter_mode", lambda: False)


def test_second_call_of_a_specialisation_skips_the_jit(cuda_stub, monkeypatch):
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    fn = FakeJIT()
    fl = L.FastLaunch(fn)
    fl((4,), 5, 6, C=3, num_warps=4)
    assert len(fn.jit_calls) == 1 and fl.compiled_count() == 1
    fl((4, 2), 7, 8, C=3, num_warps=4)  # other values, same specialisation
    assert len(fn.jit_calls) == 1
    (k,) = fn.kernels.values()
    assert k.calls == [(4, 2, 1, 77, "fn-k0", "md-k0", None, None, None, 7, 8, 3)]


def test_a_new_specialisation_or_keyword_goes_through_the_jit(cuda_stub):
    fn = FakeJIT()
    fl = L.FastLaunch(fn)
    fl((1,), 5, 6, C=3)
    fl((1,), 1, 6, C=3)  # an argument becomes 1: another specialisation
    fl((1,), 5, 6, C=4)  # another constexpr
    fl((1,), 5, 6, C=3, num_warps=8)  # another launch option
    assert len(fn.jit_calls) == 4 and fl.compiled_count() == 4
    fl((1,), 1, 9, C=3)
    assert len(fn.jit_calls) == 4


@pytest.mark.parametrize("kind", ["function", "chain"])
def test_launch_hooks_still_run(cuda_stub, monkeypatch, kind):
    fn = FakeJIT()
    fl = L.FastLaunch(fn)
    fl((2,), 5, 6, C=3)
    if kind == "function":
        hook = lambda *a: None  # noqa: E731
    else:
        hook = knobs.HookChain()
        hook.add(lambda *a: None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    fl((2,), 5, 6, C=3)
    (k,) = fn.kernels.values()
    assert k.meta_calls == [((2,), 77, (5, 6, 3))]
    assert k.calls[-1][6:8] == ({"name": "k0"}, hook)


def test_an_empty_hook_chain_builds_no_metadata(cuda_stub, monkeypatch):
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", knobs.HookChain())
    fn = FakeJIT()
    fl = L.FastLaunch(fn)
    fl((2,), 5, 6, C=3)
    fl((2,), 5, 6, C=3)
    (k,) = fn.kernels.values()
    assert k.meta_calls == [] and k.calls[-1][6:9] == (None, None, None)


def test_the_interpreter_and_plain_functions_use_the_jit(monkeypatch):
    fn = FakeJIT()
    monkeypatch.setattr(L, "interpreter_mode", lambda: True)
    fl = L.FastLaunch(fn)
    fl((1,), 5, 6, C=3)
    fl((1,), 5, 6, C=3)
    assert len(fn.jit_calls) == 2 and fl.compiled_count() == 0


def test_the_jit_can_be_forced(cuda_stub, monkeypatch):
    monkeypatch.setenv("HISPARSE_JIT_LAUNCH", "1")
    fn = FakeJIT()
    fl = L.FastLaunch(fn)
    fl((1,), 5, 6, C=3)
    fl((1,), 5, 6, C=3)
    assert len(fn.jit_calls) == 2 and fl.compiled_count() == 0
