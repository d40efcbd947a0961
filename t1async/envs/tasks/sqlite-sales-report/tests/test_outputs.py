from pathlib import Path

REPORT = Path("/app/report.csv")
EXPECTED = [
    ("Dana", "681.33"),
    ("Alice", "665.42"),
    ("Chen", "650.67"),
    ("Emeka", "362.68"),
    ("Farah", "29.62"),
]


def _lines():
    return [line.strip() for line in REPORT.read_text().splitlines() if line.strip()]


def _rows():
    return [tuple(part.strip().strip('"') for part in line.split(",")) for line in _lines()[1:]]


def test_report_exists():
    assert REPORT.is_file(), "/app/report.csv missing"


def test_header():
    assert _lines()[0].replace('"', "") == "name,total"


def test_only_customers_with_paid_orders():
    assert sorted(r[0] for r in _rows()) == sorted(name for name, _ in EXPECTED)


def test_totals():
    assert dict(_rows()) == dict(EXPECTED)


def test_sorted_by_total_desc():
    assert _rows() == EXPECTED
