from pathlib import Path

CONFIGS = Path("/app/configs")


def test_archive_extracted():
    for rel in ["README.txt", "services/web.env", "services/billing/billing.env",
                "services/billing/notes.md", "shared/defaults.env"]:
        assert (CONFIGS / rel).is_file(), f"{rel} not extracted"


def test_token_value():
    assert Path("/app/token.txt").read_text().strip() == "tk_5f2a9c71e0"


def test_token_file_path():
    value = Path("/app/token_file.txt").read_text().strip()
    if value.startswith("./"):
        value = value[2:]
    assert value == "services/billing/billing.env"
