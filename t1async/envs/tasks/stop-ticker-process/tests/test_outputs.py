import re
from pathlib import Path

TICKS = Path("/app/ticks.log")
STATUS = Path("/app/ticker.status")


def test_ticker_ran_long_enough():
    assert TICKS.is_file(), "ticker never ran"
    assert len(TICKS.read_text().splitlines()) >= 5


def test_status_written():
    assert STATUS.is_file(), "no /app/ticker.status: the ticker was not stopped with SIGTERM"


def test_stopped_by_sigterm_after_five_ticks():
    m = re.fullmatch(r"stopped by SIGTERM after (\d+) ticks", STATUS.read_text().strip())
    assert m, STATUS.read_text()
    assert int(m.group(1)) >= 5
