"""Stand-in ``sglang`` package for tests/test_sglang_launch.py (put on PYTHONPATH there only)."""
