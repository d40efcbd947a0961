"""Bad launch input is refused at once, in one line, before Ray starts and before a run directory
is created: a missing ``learner.init_checkpoint``, ``learner.resume=true`` into a folder that holds
no run; broken task folders are skipped with a count, and a folder with none usable names every one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from t1async.config import load_config
from tests.support.cli import LOCAL, REPO, assert_main_one_line


def test_a_missing_init_checkpoint_is_one_line_and_creates_no_run_dir(capsys, tmp_path):
    run_dir = tmp_path / "run"
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={run_dir}", f"learner.init_checkpoint={tmp_path}/nope"],
                         f"learner.init_checkpoint={tmp_path}/nope: no such folder", "t1async sft --out")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={run_dir}", f"learner.init_checkpoint={tmp_path}/half"],
                         "has no model.safetensors: it is not a checkpoint folder")
    assert not run_dir.exists()


def test_resume_into_a_folder_that_holds_no_run_is_refused(capsys, tmp_path):
    typo = tmp_path / "runs" / "my-rnu"
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={typo}", "learner.resume=true"],
                         f"learner.resume=true but run.dir {typo} does not exist", "drop learner.resume=true")
    assert not typo.exists()
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={tmp_path}", "learner.resume=true"],
                         "holds no run (no metrics, checkpoints or receive log)")
    assert list(tmp_path.iterdir()) == []  # nothing created, not even the lock


def test_resume_of_a_run_whose_checkpoints_all_fail_verification_is_refused(capsys, tmp_path):
    """Every checkpoint torn (a failing disk): a resume would start again from the initial weights and
    replace the run's metrics; it is refused in one line, and nothing is moved or created."""
    from tests.support.checkpoints import write_checkpoint

    run_dir = tmp_path / "run"
    for step in (6, 12):
        write_checkpoint(run_dir / "checkpoints", step)
        (run_dir / "checkpoints" / f"step_{step:06d}" / "model.safetensors").write_bytes(b"")
    (run_dir / "metrics.jsonl").write_text('{"step": 12}\n')
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={run_dir}", "learner.resume=true"],
                         f"learner.resume=true but no checkpoint in {run_dir / 'checkpoints'} can be trusted "
                         "(step_000012: model.safetensors has 0 bytes, its manifest says 700; step_000006:",
                         "put an intact step_N folder back there")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert not (run_dir / "service.lock").exists()


def test_resume_of_a_run_whose_checkpoints_are_all_gone_is_refused_unless_asked_for(capsys, tmp_path):
    """Issue 42: every checkpoint deleted, a resume started again from random weights and cut
    metrics.jsonl back. Refused in one line (the run noted a checkpoint beside its receive log);
    ``learner.resume_from_scratch=true`` lets it through the same check."""
    from t1async.learner.checkpoints import note_checkpointed
    from t1async.service.preflight import check_resumable

    run_dir = tmp_path / "run"
    for sub in ("checkpoints", "receive_log"):
        (run_dir / sub).mkdir(parents=True)
    note_checkpointed(run_dir / "receive_log", 12, fsync=False)  # as the learner's 12th step's checkpoint did
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 35)))
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={run_dir}", "learner.resume=true"],
                         "learner.resume=true but the run wrote checkpoint step_000012 before", "reaches step 34",
                         "learner.resume_from_scratch=true")
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 34 and not (run_dir / "service.lock").exists()
    check_resumable(run_dir, from_scratch=True)  # told to: no refusal
    (run_dir / "receive_log" / "checkpointed").unlink()  # killed before its first checkpoint: the log replays
    check_resumable(run_dir)


def test_an_unauthenticated_learner_port_reachable_from_other_machines_is_refused(capsys, tmp_path):
    """Issue 42: a forged frame on the open port was ACKed and trained. CurveZMQ is on by default;
    turning it off is refused unless the learner binds loopback, and a cluster needs shared keys."""
    from t1async.service.preflight import check_transport_auth

    run_dir = tmp_path / "run"
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={run_dir}", "transport.curve=false", "transport.host=0.0.0.0"],
                         "transport.curve=false with transport.host=0.0.0.0: anyone who reaches that port could "
                         "train the policy")
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={run_dir}", "ray.address=10.0.0.5:6379"],
                         "transport.keys_dir is needed with ray.address=10.0.0.5:6379")
    assert not run_dir.exists()
    cfg = load_config(LOCAL)
    assert cfg.transport.curve and not cfg.transport.keys_dir  # the default: keys made at launch
    check_transport_auth(cfg)
    cfg.transport.curve = False  # loopback (the default host) or ipc: only this machine's processes reach it
    check_transport_auth(cfg)
    cfg.transport.host = "0.0.0.0"
    cfg.transport.scheme = "ipc"
    check_transport_auth(cfg)


def test_broken_tasks_are_skipped_with_a_count_and_refused_only_when_none_is_usable(tmp_path):
    """Issue 42 item 9: one broken task folder stopped the whole launch. Broken ones are skipped,
    each named, with a count; with no usable task left every broken one is named, one line each."""
    from t1async.envs.taskio.task import TaskError
    from t1async.service.preflight import check_inputs

    good = sorted(p for p in (REPO / "t1async" / "envs" / "tasks").iterdir() if p.is_dir())[0]
    shutil.copytree(good, tmp_path / good.name)
    for name in ("broken-a", "broken-b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "instruction.md").write_text("do it")
    shutil.copytree(good, tmp_path / "broken-c")
    (tmp_path / "broken-c" / "task.toml").write_text("[task\n")  # not TOML
    from loguru import logger

    cfg = load_config(LOCAL, [f"env.tasks_dir={tmp_path}"])
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")  # (other tests replace loguru's stderr sink)
    try:
        assert check_inputs(cfg) == [good.name]
    finally:
        logger.remove(sink)
    err = "".join(lines)
    assert f"3 of 4 task folders under {tmp_path} are broken and skipped" in err
    assert all(f"{name}" in err for name in ("broken-a", "broken-b", "broken-c"))

    shutil.rmtree(tmp_path / good.name)  # nothing usable left: refused, every broken folder named
    with pytest.raises(TaskError) as err:
        check_inputs(cfg)
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"3 task folders under {tmp_path} are invalid")
    assert [Path(line.split()[1].rstrip(":")).name for line in lines[1:]] == ["broken-a", "broken-b", "broken-c"], lines


def test_a_local_ray_session_folder_is_removed_and_its_logs_kept_in_the_run_dir(tmp_path):
    from t1async.service.launch import keep_ray_logs
    from t1async.service.reaper import _local_ray_session

    run_dir, session = tmp_path / "run", tmp_path / "ray" / "session_2026-12-03_01-02-03_000000_1"
    (run_dir / "logs").mkdir(parents=True)
    (session / "logs").mkdir(parents=True)
    (session / "logs" / "raylet.out").write_text("raylet")
    (session / "sockets").mkdir()
    keep_ray_logs(str(session), run_dir)
    assert not session.exists() and (run_dir / "logs" / "ray" / "raylet.out").read_text() == "raylet"
    # after a kill -9 of the launch, its reaper finds the session in service.json (only a local Ray's)
    (run_dir / "service.json").write_text(f'{{"ray_session": "{session}", "ray_local": true}}')
    assert _local_ray_session(run_dir) == session
    (run_dir / "service.json").write_text(f'{{"ray_session": "{session}", "ray_local": false}}')
    assert _local_ray_session(run_dir) is None


def test_launch_makes_one_preflight_call_that_checks_the_input_and_creates_nothing(tmp_path, monkeypatch):
    from t1async.config import ConfigError
    from t1async.service import launch as launch_module
    from t1async.service.preflight import preflight

    run_dir = tmp_path / "run"
    cfg, resolved, names = preflight(LOCAL, [f"run.dir={run_dir}"])
    assert resolved == run_dir.resolve() and cfg.run.dir == str(run_dir) and names
    assert not run_dir.exists()  # the run directory is claimed after the pre-flight, under its lock
    calls = []

    def refuse(path, overrides):
        calls.append((path, list(overrides)))
        raise ConfigError("refused by the pre-flight")

    monkeypatch.setattr(launch_module, "preflight", refuse)
    with pytest.raises(ConfigError, match="refused by the pre-flight"):
        launch_module.launch(LOCAL, [f"run.dir={run_dir}"])
    assert calls == [(LOCAL, [f"run.dir={run_dir}"])] and not run_dir.exists()


def test_a_ray_node_that_times_out_at_start_up_is_started_again_and_other_errors_are_not(monkeypatch):
    """Ray's own start-up wait expires on a loaded machine ("The current node timed out during
    startup"): the launch tries again (up to RAY_START_ATTEMPTS in all), then says so in one line
    (main: Ray's multi-line traceback); any other error is raised at once."""
    from t1async.service import launch as launch_module

    calls = []

    def flaky(**kwargs):
        calls.append(kwargs)
        if len(calls) < 3:
            raise Exception("The current node timed out during startup. This could happen because ...")
        return "ctx"

    monkeypatch.setattr(launch_module.ray, "init", flaky)
    monkeypatch.setattr(launch_module.ray, "shutdown", lambda: None)
    cfg = load_config(None)
    assert launch_module.init_ray(cfg) == "ctx" and len(calls) == 3
    calls.clear()
    with pytest.raises(launch_module.RayStartFailed) as failed:  # the last try: one line, with the load and what to do
        launch_module.init_ray(cfg, attempts=2)
    assert len(calls) == 2
    said = str(failed.value)
    assert "\n" not in said and said.startswith("Ray's node did not start in 2 tries") and "load average" in said
    assert "ray.address" in said

    def broken(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("address in use")

    calls.clear()
    monkeypatch.setattr(launch_module.ray, "init", broken)
    with pytest.raises(RuntimeError, match="address in use"):
        launch_module.init_ray(cfg)
    assert len(calls) == 1


def test_a_ray_node_that_never_starts_ends_the_launch_in_one_line_with_exit_status_1(monkeypatch, tmp_path, capsys):
    """Every try at starting Ray times out (a machine at load 35 did this): ``t1async launch`` says
    so in one line with the load and what to do, exits with status 1, and leaves the run folder
    free for the next launch (main: Ray's traceback)."""
    from t1async import cli
    from t1async.service import launch as launch_module

    def timed_out(**kwargs):
        raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(launch_module.ray, "init", timed_out)
    monkeypatch.setattr(launch_module.ray, "shutdown", lambda: None)
    run_dir = tmp_path / "run"
    assert cli.main(["launch", LOCAL, f"run.dir={run_dir}"]) == 1
    err = capsys.readouterr().err
    said = [x for x in err.splitlines() if x.startswith("t1async: error:")]
    assert len(said) == 1 and said[0].startswith("t1async: error: Ray's node did not start in 3 tries"), err
    assert "Traceback" not in err and err.count("timed out during start-up (try") == 2  # (the console's warnings)
    monkeypatch.setattr(launch_module, "init_ray", lambda cfg: (_ for _ in ()).throw(RuntimeError("second")))
    with pytest.raises(RuntimeError, match="second"):  # the folder was released: a new launch gets past its claim
        launch_module.launch(LOCAL, [f"run.dir={run_dir}", "run.overwrite=true"])
