"""Stand-in ``sglang`` package for tests/contracts/test_sglang_launch.py (put on PYTHONPATH there only)."""
