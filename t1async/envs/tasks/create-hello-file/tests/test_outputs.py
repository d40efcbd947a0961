from pathlib import Path

TARGET = Path("/app/hello.txt")


def test_file_exists():
    assert TARGET.exists(), "/app/hello.txt does not exist"


def test_is_regular_file():
    assert TARGET.is_file(), "/app/hello.txt is not a regular file"


def test_content_is_hello():
    assert TARGET.read_text().strip() == "hello"
