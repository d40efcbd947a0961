from pathlib import Path

OUT = Path("/app/top_ips.txt")
EXPECTED = [(41, "10.0.0.5"), (33, "192.168.1.20"), (27, "172.16.4.2")]


def _rows():
    return [line.split() for line in OUT.read_text().splitlines() if line.strip()]


def test_output_exists():
    assert OUT.is_file(), "/app/top_ips.txt does not exist"


def test_exactly_three_lines():
    assert len(_rows()) == 3


def test_most_frequent_ip_first():
    assert _rows()[0] == [str(EXPECTED[0][0]), EXPECTED[0][1]]


def test_all_three_in_order():
    assert _rows() == [[str(c), ip] for c, ip in EXPECTED]
