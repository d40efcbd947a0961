"""What the tests share: fakes of the edges that cannot run here and builders of small real inputs.

Each module is imported by the tests that need it (``from tests.support.X import ...``);
``tests/conftest.py`` turns the common ones into fixtures.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout's top folder."""
TESTS = REPO / "tests"
"""tests/: the rooms, fixtures/ and fake_sglang_pkg/."""
FIXTURES = TESTS / "fixtures"
"""Small inputs committed for the tests (task folders, layouts, the pinned SGLang schema)."""
