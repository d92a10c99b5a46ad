"""The suite without the optional packages: a test that needs one skips, none fails.

matplotlib and rich (the [tools] extra), prometheus_client ([metrics]) and hypothesis
([test]) may be missing where the suite runs. This runs, in a fresh interpreter where
importing them fails as if they were not installed, every test whose name says it deals
with one of them, and collects the whole suite (a module importing one at its top
would be a collection error): all must pass or skip.
"""

import os
import subprocess
import sys

HIDDEN = ("matplotlib", "rich", "prometheus_client", "hypothesis")
# tests that use the hidden packages: plots, metrics, progress bars, property tests
SELECT = ("(plot or metrics or prometheus or progress or property or random_traces or cache_random) "
          "and not optional_deps")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RUN = """
import sys

import pytest


class Hide:  # after pytest's start-up, which walks sys.modules and needs real modules there
    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config):
        for key in list(sys.modules):
            if key.partition(".")[0] in {hidden!r}:
                del sys.modules[key]
        for name in {hidden!r}:
            sys.modules[name] = None  # import fails (ModuleNotFoundError), find_spec says absent


sys.exit(pytest.main(sys.argv[1:], plugins=[Hide()]))
"""


def test_tests_of_optional_packages_skip_without_them():
    argv = [sys.executable, "-c", _RUN.format(hidden=HIDDEN),
            "-p", "no:hypothesispytest", "-p", "no:cacheprovider",  # hypothesis' own plugin imports it
            "-q", "-rs", "-m", "not gpu and not multigpu", "-k", SELECT, "tests"]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert "error" not in out.splitlines()[-1], out[-3000:]
    for name in ("matplotlib", "hypothesis"):  # the hiding worked: tests needing them were skipped
        assert name in out, out[-3000:]
