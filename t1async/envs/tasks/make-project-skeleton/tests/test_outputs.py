from pathlib import Path

ROOT = Path("/app/project")


def test_src_dir():
    assert (ROOT / "src").is_dir()


def test_tests_dir():
    assert (ROOT / "tests").is_dir()


def test_docs_dir():
    assert (ROOT / "docs").is_dir()


def test_readme_empty_file():
    readme = ROOT / "README.md"
    assert readme.is_file(), "README.md missing"
    assert readme.stat().st_size == 0, "README.md should be empty"
