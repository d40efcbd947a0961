"""The modal backend without Modal's cloud: clear errors within 5 s, never a hang, and the image,
limits and network it asks Modal for (the fake cloud records them)."""

from __future__ import annotations

import os
import time

import pytest

from t1async.envs.protocol import SandboxLimits, SandboxSpec, SandboxUnavailable
from t1async.envs.sandboxes import modal_sandbox
from t1async.envs.sandboxes.modal_sandbox import CONNECT_TIMEOUT_S, ModalSandbox, check_modal_available
from t1async.envs.sandboxes.sandbox import SANDBOXES, make_sandbox
from tests.support import FIXTURES
from tests.support.modal_fake import FakeApp, FakeModal, FakeSandbox

FIXTURES = FIXTURES


def test_registry_has_every_backend():
    from t1async.envs.sandboxes.container import ContainerSandbox

    assert SANDBOXES == {"local": SANDBOXES["local"], "container": ContainerSandbox, "modal": ModalSandbox}
    assert ContainerSandbox.builds_image
    assert ModalSandbox.builds_image and not SANDBOXES["local"].builds_image
    assert CONNECT_TIMEOUT_S <= 5


def test_no_credentials_is_a_clear_error_at_once(tmp_path, monkeypatch):
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "missing.toml"))
    with pytest.raises(SandboxUnavailable):  # first call imports modal: not what "at once" bounds
        check_modal_available()
    started = time.monotonic()
    with pytest.raises(SandboxUnavailable, match="no Modal credentials.*MODAL_TOKEN_ID"):
        check_modal_available()
    with pytest.raises(SandboxUnavailable, match="no Modal credentials"):
        make_sandbox("modal", SandboxSpec(episode_dir=tmp_path))
    # no network round trip, no retry back-off (those take seconds); generous for a loaded machine
    assert time.monotonic() - started < 3.0


def test_unreachable_modal_fails_within_the_bound(tmp_path, monkeypatch):
    """Real `modal` library, made-up credentials, a server address nothing listens on."""
    pytest.importorskip("modal")
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-t1async-test")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-t1async-test")
    monkeypatch.setenv("MODAL_SERVER_URL", "http://10.255.255.1:9")  # unroutable: would hang ~1 min
    box = ModalSandbox(SandboxSpec(episode_dir=tmp_path), connect_timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(SandboxUnavailable, match="Modal"):
        box.start()
    assert time.monotonic() - started < 5.0


def test_hanging_lookup_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(FakeApp, "lookup_delay_s", 30.0)
    box = ModalSandbox(SandboxSpec(episode_dir=tmp_path), connect_timeout_s=0.5, modal_module=FakeModal)
    started = time.monotonic()
    with pytest.raises(SandboxUnavailable, match="did not answer App.lookup within 0.5 s"):
        box.start()
    assert time.monotonic() - started < 2.0


@pytest.mark.skipif(os.geteuid() != 0, reason="the fake Modal cloud needs root")
def test_image_limits_and_network_requested_from_modal(tmp_path):
    task_env = FIXTURES / "tasks" / "hello-env" / "environment"
    spec = SandboxSpec(episode_dir=tmp_path, allow_network=False, limits=SandboxLimits(cpus=2, memory_mb=512),
                       dockerfile=task_env / "Dockerfile", context_dir=task_env)
    box = ModalSandbox(spec, modal_module=FakeModal)
    box.start()
    try:
        created = FakeSandbox.instances[-1].kwargs
        assert created["image"].how == "dockerfile" and created["image"].args == (str(task_env / "Dockerfile"),)
        assert created["image"].kwargs["context_dir"] == str(task_env)
        assert created["block_network"] is True and created["cpu"] == 2.0 and created["memory"] == 512
        assert created["workdir"] == "/app" and created["app"] == f"app:{modal_sandbox.APP_NAME}"
        assert box.exec("echo $TEST_DIR").output == "/tests\n"
    finally:
        box.close()
    assert FakeSandbox.instances[-1].terminated
    registry = ModalSandbox(SandboxSpec(episode_dir=tmp_path, docker_image="python:3.12", allow_network=True),
                            modal_module=FakeModal)
    registry.start()
    registry.close()
    assert FakeSandbox.instances[-1].kwargs["image"].how == "registry"
    assert FakeSandbox.instances[-1].kwargs["block_network"] is False


def test_compose_sidecars_are_refused_with_the_reason(tmp_path):
    """A Modal sandbox is one container: a task with compose services beside the agent's must
    fail clearly, not run without them."""
    from t1async.envs.protocol import SandboxError, ServiceSpec

    spec = SandboxSpec(episode_dir=tmp_path, name="web", services=(ServiceSpec(name="api-server", image="x:1"),))
    with pytest.raises(SandboxError, match="api-server.*--sandbox container"):
        ModalSandbox(spec).start()
