"""``t1async bench multinode``: t1async on a Ray cluster of three nodes on this machine, and the loss of one.

Prints ONE JSON object. Starts a private Ray cluster with ``ray start`` (own temp dirs, GCS port and
Ray auth token, so it never meets another Ray session on the machine): a head marked
``learner_node`` and two workers marked ``rollout_node``, ``--num-cpus`` each. Writes CurveZMQ keys
(``t1async keys``), then runs ``t1async launch configs/multinode.yaml`` against it
(``ray.address``, tcp transport with CurveZMQ, gloo weight sync, ``ray.placement`` as shipped: the
learner and controller on the head, samplers and rollout actors over the workers in turn), at a
tiny size. After ``--steps-before`` learner steps it kills the worker node holding the most
roles (SIGKILL to every process of that node's ``ray start``: raylet, agents, workers, sandboxes),
as a machine loss, waits until every role is alive again on the nodes left and a learner step was
trained after that, then stops the service and counts the ledger (``t1async soak``'s, from the run
directory). Always tears the cluster down, on failure too.

Reported:

- ``placement_before`` / ``placement_after``: role -> node names of its live actors (Ray's GCS
  actor table, the one behind ``ray list actors``); ``victim`` and ``victim_roles``;
- ``node_marked_dead_s``: from the kill until Ray's node table says the node is dead (Ray's own
  health check: ``health_check_period_ms`` x ``health_check_failure_threshold``);
- ``roles_back_s``: until every sampler and rollout actor is alive again, none on the dead node;
  ``samplers_serving_s``: until the pool has every sampler serving again (weights re-sent);
- ``recovered_s``: until the learner trained a step after ``roles_back_s`` (the run goes on);
- ``ledger``: sent, acked, trained, dropped, ``lost``, ``duplicates_trained``, pending, steps
  (t1async/commands/soak.py ``ledger``); ``launch_rc``; ``wall_s``.

Exit status 0 when the roles came back on the nodes left, lost = 0 and duplicates = 0.

Usage: ``t1async bench multinode [--steps-before 2] [--num-cpus 1] [--timeout-s 600] [key=value ...]``
(overrides go to the launch).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# The private cluster's Ray auth token: Ray reads RAY_AUTH_MODE once, when it is first imported (below,
# through t1async), so this process can reach the cluster only if both are set before that.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

from t1async.cli import OneLineErrors, at_least_one  # noqa: E402
from t1async.commands.soak import ledger  # noqa: E402
from t1async.service.control import ControlError, request  # noqa: E402
from t1async.service.reaper import descendants  # noqa: E402
from t1async.transport.keys import write_keys  # noqa: E402

RAY_CLI = str(Path(sys.executable).with_name("ray"))  # the ray of this interpreter's environment
NODES = [("head", {"learner_node": 1}), ("worker1", {"rollout_node": 1}), ("worker2", {"rollout_node": 1})]
ROLES = {"Learner": "learner", "Controller": "controller", "EmbeddedSampler": "sampler", "RolloutActor": "rollout"}
SMALL = ["run.torch_threads=1", "run.tensorboard=false", "run.audit=true", "sampler.num_samplers=2",
         "rollout.num_actors=2", "learner.max_steps=0", "learner.batch_size=2", "learner.publish_every=1",
         "learner.checkpoint_every=0", "env.max_turns=2", "generation.max_new_tokens=16",
         "transport.host=127.0.0.1", "transport.port=0", "transport.log_fsync=never",
         "weight_sync.backend=gloo", "weight_sync.master_address=127.0.0.1"]
"""The tiny run: two samplers and two rollout actors (one of each per worker: placement takes them in turn)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pgid(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2:].split()[2])


def node_processes(pgid: int) -> set[int]:
    """Every live process of one local Ray node: the members of its ``ray start``'s process group
    (GCS, raylet, log monitor: they daemonize but keep the group) and all their descendants (the
    raylet's workers and agents, which take process groups of their own, and what they started)."""
    members = {int(e) for e in os.listdir("/proc") if e.isdigit() and _pgid(int(e)) == pgid}
    found = set(members)
    for pid in members:
        found.update(descendants(pid))
    return found


REJOIN_AFTER_S = 60.0
"""How long a worker node whose ``ray start`` gave up may take to join before it is started again."""


@dataclass
class Node:
    """One ``ray start`` of a :class:`LocalCluster`."""

    name: str
    resources: dict[str, float]
    temp_dir: Path
    pgid: int = 0
    """Process group of its ``ray start`` (started in a session of its own)."""


class LocalCluster:
    """A Ray cluster of several nodes on this machine, each one ``ray start`` in a session of its
    own with a temp dir of its own (short: Unix socket paths have a 107-byte limit), the head on a
    free GCS port, all on 127.0.0.1 with this process's private Ray auth token (``RAY_AUTH_MODE=token``,
    ``RAY_AUTH_TOKEN``, set when this module is imported), so it neither joins nor disturbs another
    Ray session on the machine. ``env`` is what a process needs
    to reach it (``t1async launch`` included). Use as a context manager: :meth:`close` kills every
    node's processes, also after a failure.

    Args:
        nodes: (name, custom resources) per node, the head first.
        num_cpus: CPUs each node advertises.
    """

    def __init__(self, nodes: list[tuple[str, dict[str, float]]], num_cpus: int = 1):
        self.root = Path(tempfile.mkdtemp(prefix="t1mn-", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.num_cpus = num_cpus
        self.nodes = [Node(name, res, self.root / name) for name, res in nodes]
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": path,
                    # the raylet waits this long for its agents: minutes on a loaded 2-core machine
                    "RAY_agent_register_timeout_ms": "180000"}
        self.env.pop("RAY_ADDRESS", None)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, timeout_s: float = 300.0) -> None:
        """Start the head, then the workers together, and connect this process to the cluster
        (``ray.init``); returns once Ray's node table has every node alive.

        A ``ray start`` that gives up (it waits a fixed 30 s for its raylet to register, which a
        loaded 2-core machine can exceed) is not fatal by itself: its raylet usually goes on and registers.
        A worker node whose ``ray start`` gave up and that has not joined :data:`REJOIN_AFTER_S` later is
        killed and started again, up to twice (seen once in a test run at load 30: the node never joined).

        Raises:
            RuntimeError: a node was not alive within ``timeout_s`` (the tail of its ``ray start`` output).
        """
        import ray  # (ray: deferred)

        deadline = time.monotonic() + timeout_s
        head, *workers = self.nodes
        self._wait([self._start(head, ["--head", f"--port={self.port}", "--include-dashboard=false"])], deadline)
        worker_args = [f"--address={self.address}"]
        started = {n.name: self._start(n, worker_args) for n in workers}
        self._wait(list(started.values()), deadline)
        gave_up = {name: time.monotonic() for name, proc in started.items() if proc.returncode not in (0, None)}
        restarts = dict.fromkeys(gave_up, 0)
        ray.init(address=self.address, log_to_driver=False, logging_level="WARNING")
        while True:
            alive = {self.name_of(n) for n in ray.nodes() if n["Alive"]}
            missing = [n for n in self.nodes if n.name not in alive]
            if not missing:
                return
            if time.monotonic() > deadline:
                tail = (self.root / f"{missing[0].name}.out").read_text()[-1500:]
                raise RuntimeError(f"Ray node {missing[0].name} did not join within {timeout_s:.0f} s: {tail}")
            for node in missing:
                since = gave_up.get(node.name)
                if since is None or time.monotonic() - since < REJOIN_AFTER_S or restarts[node.name] >= 2:
                    continue
                self.kill(node.name)
                restarts[node.name] += 1
                node.temp_dir = self.root / f"{node.name}-{restarts[node.name]}"
                proc = self._start(node, worker_args)
                self._wait([proc], deadline)
                gave_up[node.name] = time.monotonic()  # (the next restart, if any, waits again)
            time.sleep(0.5)

    def _start(self, node: Node, args: list[str]) -> subprocess.Popen:
        node.temp_dir.mkdir(parents=True)
        out = open(self.root / f"{node.name}.out", "a")  # noqa: SIM115 (a restart appends)
        proc = subprocess.Popen([RAY_CLI, "start", *args, f"--temp-dir={node.temp_dir}", "--node-ip-address=127.0.0.1",
                                 f"--num-cpus={self.num_cpus}", f"--resources={json.dumps(node.resources)}",
                                 "--disable-usage-stats"], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        node.pgid = proc.pid
        return proc

    @staticmethod
    def _wait(started: list[subprocess.Popen], deadline: float) -> None:
        for proc in started:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # (its daemons stay: start() waits for the node to join)

    def node(self, name: str) -> Node:
        """The node called ``name``."""
        return next(n for n in self.nodes if n.name == name)

    def name_of(self, ray_node: dict[str, Any]) -> str:
        """Our name of a row of Ray's node table (``ray.nodes()``), by its raylet's socket under our temp dir."""
        sock = str(ray_node.get("RayletSocketName", ""))
        return next((n.name for n in self.nodes if sock.startswith(str(n.temp_dir) + "/")), "?")

    def kill(self, name: str) -> int:
        """SIGKILL every process of node ``name`` at once (a machine loss); how many there were."""
        pids = node_processes(self.node(name).pgid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        return len(pids)

    def close(self) -> None:
        """Disconnect, kill every node (workers first), wait for their processes to go, remove the temp dirs."""
        import ray  # (ray: deferred)

        ray.shutdown()
        for node in reversed(self.nodes):
            if node.pgid:
                self.kill(node.name)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(node_processes(n.pgid) for n in self.nodes if n.pgid):
            time.sleep(0.2)
        shutil.rmtree(self.root, ignore_errors=True)


def placement(cluster: LocalCluster) -> dict[str, list[str]]:
    """Role -> sorted node names of its live actors, from Ray's GCS actor and node tables."""
    import ray  # (ray: deferred, as in the roles)
    from ray._private.state import actors  # the GCS actor table (``ray list actors`` reads it too)

    names = {n["NodeID"]: cluster.name_of(n) for n in ray.nodes()}
    out: dict[str, list[str]] = {}
    for a in actors().values():
        role = ROLES.get(a["ActorClassName"])
        if role and a["State"] == "ALIVE":
            out.setdefault(role, []).append(names.get(a["Address"]["NodeID"], "?"))
    return {k: sorted(v) for k, v in sorted(out.items())}


def _status(run_dir: Path) -> dict | None:
    try:
        return request(run_dir, {"cmd": "status"}, timeout_s=30)
    except ControlError:
        return None


def _wait(fn: Callable[[], Any], timeout_s: float, what: str, proc: subprocess.Popen, log: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        if proc.poll() is not None:
            raise RuntimeError(f"the launch exited {proc.returncode} while waiting for {what}: "
                               f"{log.read_text()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}; see {log}")


def run(out_dir: Path, *, steps_before: int = 2, num_cpus: int = 1, timeout_s: float = 600.0,
        overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Start the cluster, launch, lose a worker node, recover, stop; the report (see the module docstring).

    Args:
        out_dir: where the run directory (``run/``), the keys (``keys/``) and the launch's output go.
        steps_before: learner steps before the node is killed.
        num_cpus: CPUs each Ray node advertises.
        timeout_s: the longest wait for each phase (cluster start, first steps, recovery, stop).
        overrides: more ``key=value`` for the launch.

    Raises:
        RuntimeError: a phase failed or timed out (the message says which, with the output's tail).
    """
    import ray  # (ray: deferred)

    t0 = time.monotonic()
    run_dir, keys = out_dir / "run", out_dir / "keys"
    write_keys(keys)
    res: dict[str, Any] = {"bench": "multinode"}
    with LocalCluster(NODES, num_cpus=num_cpus) as cluster:
        cluster.start(timeout_s)
        res["cluster_start_s"] = round(time.monotonic() - t0, 1)
        log = out_dir / "launch.out"
        cmd = [sys.executable, "-m", "t1async.cli", "launch", str(REPO / "configs" / "multinode.yaml"),
               f"ray.address={cluster.address}", f"run.dir={run_dir}", f"transport.keys_dir={keys}",
               f"transport.spool_dir={run_dir / 'spool'}", *SMALL, *overrides]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster.env, cwd=REPO,
                                    start_new_session=True)
        try:
            _wait(lambda: (s := _status(run_dir)) and s.get("step", 0) >= steps_before, timeout_s,
                  f"{steps_before} learner steps", proc, log)
            res["first_steps_s"] = round(time.monotonic() - t0, 1)
            before = placement(cluster)
            res["placement_before"] = before
            workers = [n.name for n in cluster.nodes[1:]]
            victim = max(reversed(workers), key=lambda w: sum(v.count(w) for v in before.values()))
            res["victim"] = victim
            res["victim_roles"] = {r: v.count(victim) for r, v in before.items() if victim in v}
            want = {"sampler": len(before.get("sampler", [])), "rollout": len(before.get("rollout", []))}
            victim_id = next(n["NodeID"] for n in ray.nodes() if cluster.name_of(n) == victim)
            step_at_kill = _status(run_dir)["step"]

            lost_samplers = before.get("sampler", []).count(victim)
            t_kill, kill_wall = time.monotonic(), time.time()
            res["victim_processes_killed"] = cluster.kill(victim)
            marks: dict[str, float] = {}

            def back() -> bool:
                now = time.monotonic() - t_kill
                if "node_marked_dead_s" not in marks and not any(
                        n["Alive"] for n in ray.nodes() if n["NodeID"] == victim_id):
                    marks["node_marked_dead_s"] = now
                where = placement(cluster)
                if "roles_back_s" not in marks and all(
                        len(where.get(r, [])) == k and victim not in where.get(r, []) for r, k in want.items()):
                    marks["roles_back_s"], marks["step_at_back"] = now, (_status(run_dir) or {}).get("step", 0)
                st = _status(run_dir) or {}
                samplers = st.get("samplers", [])
                if "samplers_serving_s" not in marks and len(samplers) == want["sampler"] and \
                        all(s["state"] == "serving" for s in samplers) and \
                        sum((s.get("serving_at") or 0) > kill_wall for s in samplers) >= lost_samplers:
                    marks["samplers_serving_s"] = now  # (the restarted ones hold the current weights again)
                if "roles_back_s" in marks and "samplers_serving_s" in marks and \
                        st.get("step", 0) > marks["step_at_back"]:
                    marks["recovered_s"] = now
                    return True
                return False

            _wait(back, timeout_s, "the roles to come back on the nodes left and a step after", proc, log)
            res.update({k: round(v, 1) for k, v in marks.items() if k.endswith("_s")})
            res["step_at_kill"] = step_at_kill
            res["placement_after"] = placement(cluster)
            last = _status(run_dir)
            res["restarts"] = (last or {}).get("restarts")
            res["rollout_crashes"] = (last or {}).get("controller", {}).get("crashes")
            request(run_dir, {"cmd": "stop"})
            res["launch_rc"] = proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    max_staleness = int(next((o.split("=", 1)[1] for o in overrides if o.startswith("learner.max_staleness=")), 2))
    led = ledger(run_dir, max_staleness, last)
    res["ledger"] = {k: led[k] for k in ("sent", "acked", "trained", "dropped", "lost", "duplicates_trained",
                                         "pending", "steps", "staleness_max")}
    res["run_dir"] = str(run_dir)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrors(prog="t1async bench multinode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps-before", type=at_least_one, default=2)
    ap.add_argument("--num-cpus", type=at_least_one, default=1)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--out", default="", help="folder for the run directory, keys and logs (default: a new temp dir)")
    ap.add_argument("overrides", nargs="*", default=[])
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench-multinode-"))
    out.mkdir(parents=True, exist_ok=True)
    res = run(out, steps_before=a.steps_before, num_cpus=a.num_cpus, timeout_s=a.timeout_s, overrides=a.overrides)
    print(json.dumps(res))
    ok = res["ledger"]["lost"] == 0 and res["ledger"]["duplicates_trained"] == 0 and res.get("launch_rc") == 0 \
        and res["victim"] not in sum(res["placement_after"].values(), [])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
