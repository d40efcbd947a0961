from pathlib import Path

CONF = Path("/app/app.conf")
EXPECTED = [
    "# Inventory service settings",
    "# debug = true   <- never enable this in production",
    "name = inventory",
    "debug = false",
    "port = 9090",
    "log_level = info",
    "# fallback port = 8080",
    "workers = 4",
]


def _lines():
    return CONF.read_text().splitlines()


def test_debug_disabled():
    assert "debug = false" in _lines()
    assert "debug = true" not in _lines()


def test_port_changed():
    assert "port = 9090" in _lines()
    assert "port = 8080" not in _lines()


def test_comments_untouched():
    comments = [line for line in _lines() if line.startswith("#")]
    assert comments == [line for line in EXPECTED if line.startswith("#")]


def test_whole_file():
    assert _lines() == EXPECTED
