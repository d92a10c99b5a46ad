"""What the CLI tests share: running ``hisparse`` in-process and checking a refusal."""

from __future__ import annotations

from hisparse_tools.cli import main


def fails(capsys, argv, rc, *needles, absent=()):
    """main(argv) exits ``rc`` with one line on stderr holding every needle and none of
    ``absent``, no traceback; returns the line."""
    got = main(argv)
    out = capsys.readouterr()
    err = out.err.strip()
    assert "Traceback" not in out.err + out.out, out.err
    assert got == rc, (got, err)
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    for n in absent:
        assert n not in err, (n, err)
    return err
