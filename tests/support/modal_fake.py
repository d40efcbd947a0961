"""A fake of Modal's cloud for tests: the ``modal`` API surface t1async uses, backed by a local
"container" (a privileged bubblewrap PID + mount namespace running ``sleep infinity``, entered
with ``nsenter`` for every ``exec``, as root, like a Modal container). Only the cloud is fake:
:class:`~t1async.envs.sandboxes.modal_sandbox.ModalSandbox` runs unchanged against it.

Needs root (privileged bubblewrap, nsenter); the tests that use it skip otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


class FakeStdin:
    def __init__(self, stream):
        self._stream = stream

    def write(self, data: bytes | str) -> None:
        self._stream.write(data.encode() if isinstance(data, str) else data)

    def drain(self) -> None:
        self._stream.flush()

    def write_eof(self) -> None:
        self._stream.close()


class FakeStdout:
    def __init__(self, stream, text: bool):
        self._stream, self._text = stream, text

    def __iter__(self):
        while True:
            chunk = os.read(self._stream.fileno(), 65536)
            if not chunk:
                return
            yield chunk.decode() if self._text else chunk

    def read(self):
        data = self._stream.read()
        return data.decode() if self._text else data


class FakeProcess:
    def __init__(self, popen: subprocess.Popen, text: bool):
        self._popen = popen
        self.stdin = FakeStdin(popen.stdin)
        self.stdout = FakeStdout(popen.stdout, text)
        self.returncode: int | None = None

    def wait(self) -> int:
        self.returncode = self._popen.wait()
        return self.returncode


class FakeFilesystem:
    def __init__(self, sandbox: FakeSandbox):
        self._sb = sandbox

    def _host(self, path: str) -> Path:
        return Path(f"/proc/{self._sb.main_pid}/root") / path.lstrip("/")

    def write_bytes(self, data: bytes, remote_path: str) -> None:
        host = self._host(remote_path)
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(bytes(data))

    def make_directory(self, remote_path: str, *, create_parents: bool = True) -> None:
        self._host(remote_path).mkdir(parents=create_parents, exist_ok=True)


class FakeSandbox:
    """One fake container; ``created`` records the create() keyword arguments."""

    instances: list[FakeSandbox] = []

    def __init__(self, args: tuple[str, ...], kwargs: dict[str, Any]):
        self.kwargs = kwargs
        self.root = Path(tempfile.mkdtemp(prefix="t1async-fake-modal-"))
        for name in ("app", "tests", "logs", "tmp", "root"):
            (self.root / name).mkdir()
        argv = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
                "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc", "--proc", "/proc", "--dev", "/dev",
                *[a for n in ("bin", "lib", "lib64", "sbin") if os.path.islink(f"/{n}")
                  for a in ("--symlink", os.readlink(f"/{n}"), f"/{n}")],
                "--bind", str(self.root / "tmp"), "/tmp", "--bind", str(self.root / "root"), "/root",
                "--bind", str(self.root / "app"), "/app", "--bind", str(self.root / "tests"), "/tests",
                "--bind", str(self.root / "logs"), "/logs"]
        read_fd, write_fd = os.pipe()
        argv += ["--info-fd", str(write_fd), "--", *args]
        self._popen = subprocess.Popen(argv, pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        import json

        data = b""
        while not data.endswith(b"}"):
            chunk = os.read(read_fd, 4096)
            if not chunk:
                break
            data += chunk.strip()
        os.close(read_fd)
        self.init_pid = int(json.loads(data)["child-pid"])  # bwrap's pid 1; the container's main process:
        deadline = time.monotonic() + 10
        while not (kids := Path(f"/proc/{self.init_pid}/task/{self.init_pid}/children").read_text().split()):
            if time.monotonic() > deadline:
                raise RuntimeError("fake container did not start")
            time.sleep(0.005)
        self.main_pid = int(kids[0])
        self.filesystem = FakeFilesystem(self)
        self.terminated = False
        FakeSandbox.instances.append(self)

    def exec(self, *args: str, text: bool = True, env: dict | None = None, workdir: str | None = None,
             timeout: int | None = None, **_: Any) -> FakeProcess:
        prefix = ["nsenter", "-t", str(self.main_pid), "-p", "-m", "-r"]
        environment = ["env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/root",
                       *[f"{k}={v}" for k, v in (env or {}).items()]]
        cd = ["sh", "-c", 'cd "$0" && exec "$@"', workdir or self.kwargs.get("workdir") or "/"]
        popen = subprocess.Popen(prefix + ["--"] + environment + cd + list(args), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return FakeProcess(popen, text)

    def terminate(self) -> None:
        self.terminated = True
        try:
            os.killpg(self._popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._popen.wait()
        subprocess.run(["rm", "-rf", str(self.root)], check=False)


class FakeImage:
    def __init__(self, how: str, *args: Any, **kwargs: Any):
        self.how, self.args, self.kwargs = how, args, kwargs

    @classmethod
    def from_dockerfile(cls, path: str, **kwargs: Any) -> FakeImage:
        return cls("dockerfile", path, **kwargs)

    @classmethod
    def from_registry(cls, tag: str, **kwargs: Any) -> FakeImage:
        return cls("registry", tag, **kwargs)

    @classmethod
    def debian_slim(cls, **kwargs: Any) -> FakeImage:
        return cls("debian_slim", **kwargs)


class FakeApp:
    lookup_delay_s = 0.0

    @classmethod
    def lookup(cls, name: str, *, create_if_missing: bool = False) -> str:
        time.sleep(cls.lookup_delay_s)
        return f"app:{name}"


class FakeSandboxFactory:
    @staticmethod
    def create(*args: str, **kwargs: Any) -> FakeSandbox:
        return FakeSandbox(args, kwargs)


class FakeModal:
    """Stands in for the ``modal`` module (``App``, ``Image``, ``Sandbox``)."""

    App = FakeApp
    Image = FakeImage
    Sandbox = FakeSandboxFactory
