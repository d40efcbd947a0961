"""The soak's disk and memory accounting (t1async/commands/soak.py): growth per 10,000 trajectories."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from t1async.commands.soak import dir_bytes, disk_by_part, growth_per_10k, resources, tree_rss_bytes
from tests.support import REPO


def test_growth_is_the_least_squares_slope_per_10k_trajectories():
    samples = [{"sent": s, "disk": 1_000 + 5 * s + (3 if s % 2 else -3), "rss": 7.0} for s in range(0, 400, 20)]
    assert abs(growth_per_10k(samples, "disk") - 50_000) < 50  # 5 bytes per trajectory, noise +-3
    assert growth_per_10k(samples, "rss") == 0.0
    assert growth_per_10k(samples[:2], "disk") is None  # too few points
    assert growth_per_10k([{"sent": 5, "disk": d} for d in (1, 2, 3)], "disk") is None  # no spread in sent


def test_resources_leave_out_the_first_quarter_as_start_up():
    start = [{"sent": s, "disk": 10 ** 9 * (s + 1), "rss": 1} for s in range(4)]  # start-up: steep
    flat = [{"sent": s, "disk": 5 * 10 ** 9, "rss": 2} for s in range(4, 16)]
    r = resources(start + flat)
    assert r["samples"] == 16 and r["disk_bytes_max"] == 5 * 10 ** 9 and r["rss_bytes_first"] == 1
    assert r["disk_growth_bytes_per_10k_trajectories"] == 0.0 and r["rss_growth_bytes_per_10k_trajectories"] == 0.0
    assert resources([]) == {"samples": 0}
    parts = resources([{"sent": s, "disk": 0, "rss": 0, "parts": {"metrics.jsonl": 100 * s, "checkpoints": 7}}
                       for s in range(8)])
    assert parts["disk_growth_bytes_per_10k_trajectories_by_part"] == {"checkpoints": 0.0, "metrics.jsonl": 1_000_000.0}


def test_dir_bytes_counts_regular_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"1" * 1000)
    (tmp_path / "y").write_bytes(b"2" * 24)
    (tmp_path / "link").symlink_to(tmp_path / "y")
    assert dir_bytes(tmp_path) == 1024
    assert disk_by_part(tmp_path) == {"a": 1000, "y": 24}


def test_tree_rss_counts_descendants():
    own = tree_rss_bytes(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(96 << 20); b[::4096] = b'x' * len(b[::4096]); "
                              "print('ready', flush=True); import time; time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(0.2)
        assert tree_rss_bytes(os.getpid()) - own > 90 << 20
    finally:
        child.kill()
        child.wait()


def test_a_soak_says_how_it_goes_in_one_line():
    from t1async.commands.soak import progress_line

    line = progress_line(2.5, 20, {"step": 14, "restarts": {"learner": 1, "samplers": 2},
                                   "dropped": {"stale": 0, "aborted": 3}}, {"rollout": 3, "sampler": 1, "learner": 1}, 120)
    assert line == ('2.5/20 min  step 14  sent 120  kills rollout 3 sampler 1 learner 1  restarts learner 1 samplers 2  '
                    'dropped {"aborted": 3}')
    assert progress_line(0.0, 1, None, {"rollout": 0}, 0).startswith("0.0/1 min  step -  sent 0")


def test_a_soak_writes_nothing_beside_its_run_dir(tmp_path, monkeypatch, capsys):
    """The launch's output goes inside the run directory (here a launch that exits at once)."""
    import subprocess

    import pytest

    from t1async.commands import soak as soak_mod

    class Exited:
        pid, returncode = 0, 1

        def __init__(self, args, stdout, **kwargs):
            stdout.write("launch output\n")

        def poll(self):
            return 1

    monkeypatch.setattr(subprocess, "Popen", Exited)
    run_dir = tmp_path / "soak-run"
    with pytest.raises(RuntimeError, match="did not make a first step"):
        soak_mod.soak(str(REPO / "configs" / "local.yaml"), 0.1, 0, [], run_dir=run_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["soak-run"]
    assert (run_dir / soak_mod.LAUNCH_OUT).read_text() == "launch output\n"
    assert f"launched the service in {run_dir}" in capsys.readouterr().err  # progress on stderr from the start
