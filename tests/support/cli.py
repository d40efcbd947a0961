"""The CLI entry point's one-line errors and the shipped local config."""

from __future__ import annotations

from tests.support import REPO

LOCAL = str(REPO / "configs" / "local.yaml")
# ---- found when tried as a new user would: each bad input is one line, status 2 (in process: fast) ----
def assert_main_one_line(capsys, argv: list[str], *needles: str) -> str:
    from t1async.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("t1async: error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]
