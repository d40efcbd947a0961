from pathlib import Path

OUT = Path("/app/error_count.txt")
EXPECTED = 39


def test_output_exists():
    assert OUT.is_file(), "/app/error_count.txt does not exist"


def test_output_is_a_number():
    assert OUT.read_text().strip().isdigit(), f"not a number: {OUT.read_text()!r}"


def test_count_is_correct():
    assert int(OUT.read_text().strip()) == EXPECTED
