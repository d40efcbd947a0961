import json
from pathlib import Path

OUT = Path("/app/extracted")


def test_guide_extracted():
    assert (OUT / "docs/guide.txt").read_text() == "Step 1: unpack\nStep 2: run\n"


def test_faq_extracted():
    assert (OUT / "docs/faq.txt").read_text() == "Q: where are logs?\nA: in /var/log\n"


def test_settings_extracted():
    assert json.loads((OUT / "config/settings.json").read_text()) == {"mode": "production", "retries": 3}
