from pathlib import Path

APP = Path("/app")


def test_leader_pid_recorded():
    assert (APP / "leader.pid").is_file(), "/app/leader.pid missing"
    assert (APP / "leader.pid").read_text().strip().isdigit()


def test_leader_pid_correct():
    real = (APP / ".state/leader.pid").read_text().strip()
    assert (APP / "leader.pid").read_text().strip() == real


def test_leader_stopped_with_sigterm():
    marker = APP / "stopped/leader"
    assert marker.is_file(), "the leader worker was not stopped with SIGTERM"
    assert marker.read_text().strip() == "leader stopped by SIGTERM"


def test_other_workers_not_stopped():
    assert (APP / "stopped/leader").is_file(), "the leader worker was not stopped"
    for role in ("alpha", "beta"):
        assert not (APP / "stopped" / role).exists(), f"worker {role} was stopped too"
