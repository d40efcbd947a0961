"""``t1async bench cluster-rehearsal``: configs/cluster.yaml, the mission's own file, run on this machine's CPUs.

Prints ONE JSON object. What a GPU cluster would run, with only what cannot exist here stood in:

- a private Ray cluster of two nodes on this machine (``ray start`` each; tools/bench_multinode.py's
  :class:`LocalCluster`: own temp dirs, GCS port and auth token, torn down on failure too) that the launch
  joins through ``ray.address`` as cluster.yaml's ``ray.address: auto`` would;
- a tiny ``qwen3_5_moe`` model folder (Gated DeltaNet and gated-attention layers, routed experts with a gated
  shared expert) written by ``t1async model init`` with the real Qwen3.5 tokenizer and chat template
  (t1async/models/hf_tokenizers.py ``qwen3.5``), given as ``model.path`` exactly as cluster.yaml's header says;
- the megatron learner on two gloo ranks (``--layout``, default expert parallel 2: rank 0 in the learner,
  rank 1 a Ray actor) in float32 on CPU instead of bfloat16 on CUDA;
- embedded samplers (they serve SGLang's HTTP protocol: t1async/sampling/embedded_http.py) instead of
  ``python -m sglang.launch_server``, and gloo weight broadcast instead of NCCL;
- tcp + CurveZMQ transport as shipped (keys written by ``t1async keys``'s code), on 127.0.0.1.

Run 1 trains ``--steps`` steps and checkpoints the last; run 2 resumes that run directory
(``learner.resume=true``) on another layout (``--resume-layout``, default one rank) and trains ``--more-steps``
more. Everything else is cluster.yaml as shipped plus the size overrides in :data:`CPU` (key=value, as a
user gives them).

Reported: ``rows`` (per learner step of both runs: step, version, trajectories, drift_tokens, routing_diff_frac,
template_mismatches, logprob_diff_mean, staleness_max), ``ranks_log`` (each run's "megatron ranks: ..." line),
``optimisers_fresh`` (run 2 logged that its optimiser state is another layout's), ``resumed`` (run 2's "resumed
from ..." line), ``checkpoints`` (step folders left), ``launch_rc`` per run, ``cluster_start_s``,
``run_s`` per run and ``wall_s``.

Exit status 0 when both runs exited 0, every row has drift 0 and routing diff 0, and run 2 resumed at run 1's
last step and trained on to ``--steps`` + ``--more-steps``.

Usage: ``t1async bench cluster-rehearsal --tokenizer DIR [--steps 2] [--more-steps 1] [--layout ep=2]
[--resume-layout tp=1] [--timeout-s 600] [--out DIR] [key=value ...]`` (overrides go to both launches).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_multinode import REPO, LocalCluster  # noqa: E402  (sets the private Ray auth token before ray loads)

from t1async.cli import OneLineErrors, at_least_one  # noqa: E402
from t1async.transport.keys import write_keys  # noqa: E402

CLUSTER_YAML = REPO / "configs" / "cluster.yaml"
NODES = [("head", {}), ("worker", {})]
"""Two Ray nodes: cluster.yaml places nothing (``ray.placement`` empty), so Ray puts the roles where it likes."""
SIZES = ["hidden_size=32", "num_hidden_layers=2", "num_attention_heads=4", "num_key_value_heads=2", "head_dim=16",
         "num_experts=4", "num_experts_per_tok=2", "moe_intermediate_size=32", "shared_expert_intermediate_size=32",
         "linear_num_key_heads=2", "linear_num_value_heads=4", "linear_key_head_dim=16", "linear_value_head_dim=16",
         "max_position_embeddings=4096"]
"""The tiny qwen3_5_moe folder (``t1async model init`` size keys): layer 0 Gated DeltaNet, layer 1 gated attention."""
CPU = ["sampler.backend=embedded", "sampler.num_samplers=2", "rollout.num_actors=2", "run.torch_threads=1",
       "run.tensorboard=false", "weight_sync.backend=gloo", "learner.megatron.device=cpu",
       "learner.megatron.dtype=float32", "learner.megatron.dispatcher=allgather", "learner.batch_size=2",
       "env.max_turns=2", "generation.max_new_tokens=16", "transport.port=0", "transport.log_fsync=never"]
"""cluster.yaml's GPU-only values swapped for CPU ones, and a tiny run's sizes."""
LAYOUT_KEYS = {"ep": "expert_parallel", "tp": "tensor_parallel", "pp": "pipeline_parallel"}


def layout(text: str) -> dict[str, int]:
    """``ep=2,tp=1`` -> {"expert_parallel": 2, "tensor_parallel": 1, "pipeline_parallel": 1} (unnamed sizes 1)."""
    out = dict.fromkeys(LAYOUT_KEYS.values(), 1)
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in LAYOUT_KEYS or not value.isdigit() or int(value) < 1:
            raise ValueError(f"layout {text!r}: use ep=N,tp=N,pp=N with N >= 1")
        out[LAYOUT_KEYS[key]] = int(value)
    return out


def layout_overrides(sizes: dict[str, int]) -> list[str]:
    """The launch's ``learner.megatron.*`` overrides of a :func:`layout`."""
    return [f"learner.megatron.{k}={v}" for k, v in sizes.items()]


def model_folder(out: Path, tokenizer: Path) -> Path:
    """The tiny qwen3_5_moe folder (:data:`SIZES`) under ``out``, written by ``t1async model init``."""
    folder = out / "policy"
    cmd = [sys.executable, "-m", "t1async.cli", "model", "init", "--family", "qwen3_5_moe", "--tokenizer",
           str(tokenizer), "--out", str(folder), *SIZES]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"t1async model init failed: {proc.stderr[-2000:]}")
    return folder


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    keep = ("step", "version", "trajectories", "drift_tokens", "routing_diff_frac", "template_mismatches",
            "logprob_diff_mean", "staleness_max")
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [{k: r.get(k) for k in keep} for r in rows]


def launch(cluster: LocalCluster, machine: list[str], more: list[str], log: Path, timeout_s: float) -> tuple[int, float]:
    """One ``t1async launch configs/cluster.yaml`` on ``cluster``; (exit status, seconds)."""
    cmd = [sys.executable, "-m", "t1async.cli", "launch", str(CLUSTER_YAML), f"ray.address={cluster.address}",
           *machine, *more]
    t0 = time.monotonic()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster.env, cwd=REPO,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, round(time.monotonic() - t0, 1)


def run(out: Path, tokenizer: Path, *, steps: int = 2, more_steps: int = 1, first: str = "ep=2",
        second: str = "tp=1", timeout_s: float = 600.0, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Both runs (see the module docstring); the report.

    Raises:
        ValueError: a bad layout; RuntimeError: the model folder or the Ray cluster could not be made.
    """
    t0 = time.monotonic()
    first_sizes, second_sizes = layout(first), layout(second)
    folder = model_folder(out, tokenizer)
    run_dir, keys = out / "run", out / "keys"
    write_keys(keys)
    machine = [f"model.path={folder}", "transport.host=127.0.0.1", "weight_sync.master_address=127.0.0.1",
               f"transport.keys_dir={keys}", f"transport.spool_dir={out / 'spool'}", f"run.dir={run_dir}", *CPU,
               *overrides]
    res: dict[str, Any] = {"bench": "cluster-rehearsal", "layouts": [first_sizes, second_sizes]}
    with LocalCluster(NODES, num_cpus=2) as cluster:
        cluster.start(timeout_s)
        res["cluster_start_s"] = round(time.monotonic() - t0, 1)
        res["launch_rc"], res["run_s"] = [], []
        for i, (sizes, more) in enumerate((
                (first_sizes, [f"learner.max_steps={steps}", f"learner.checkpoint_every={steps}"]),
                (second_sizes, [f"learner.max_steps={steps + more_steps}", "learner.checkpoint_every=0",
                                "learner.resume=true"]))):
            rc, secs = launch(cluster, machine, [*layout_overrides(sizes), *more], out / f"launch{i + 1}.out", timeout_s)
            res["launch_rc"].append(rc)
            res["run_s"].append(secs)
            log = (run_dir / "logs" / "learner.log").read_text() if (run_dir / "logs" / "learner.log").exists() else ""
            if i == 0:
                res["rows_first"] = len(_rows(run_dir))
                res["checkpoint"] = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
            if rc != 0:
                res["launch_tail"] = (out / f"launch{i + 1}.out").read_text()[-3000:]
                break
    log = (run_dir / "logs" / "learner.log").read_text() if (run_dir / "logs" / "learner.log").exists() else ""
    res["ranks_log"] = re.findall(r"megatron ranks: [^\n]*", log)
    res["resumed"] = re.findall(r"resumed from [^\n]*", log)
    res["optimisers_fresh"] = "parallel layout" in log and "optimisers start fresh" in log
    res["rows"] = _rows(run_dir)
    res["checkpoints"] = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    res["run_dir"] = str(run_dir)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


def ok(res: dict[str, Any], steps: int, more_steps: int) -> bool:
    """The rehearsal's verdict (see the module docstring)."""
    rows = res.get("rows", [])
    return (res.get("launch_rc") == [0, 0] and [r["step"] for r in rows] == list(range(1, steps + more_steps + 1))
            and res.get("rows_first") == steps and bool(res.get("resumed"))
            and all(r["drift_tokens"] == 0 and r["routing_diff_frac"] == 0 for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrors(prog="t1async bench cluster-rehearsal", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="", help="a tokenizer folder with the Qwen3.5 chat template "
                    "(default: t1async/models/hf_tokenizers.py's qwen3.5, built offline)")
    ap.add_argument("--steps", type=at_least_one, default=2)
    ap.add_argument("--more-steps", type=at_least_one, default=1)
    ap.add_argument("--layout", default="ep=2", help="run 1's learner layout, e.g. ep=2 or pp=2 or tp=2")
    ap.add_argument("--resume-layout", default="tp=1", help="run 2's learner layout (default: one rank)")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--out", default="", help="folder for the model, run directory, keys and logs (default: a new temp dir)")
    ap.add_argument("overrides", nargs="*", default=[])
    a = ap.parse_args(argv)
    try:
        layout(a.layout), layout(a.resume_layout)
    except ValueError as e:
        ap.error(str(e))
    tokenizer = Path(a.tokenizer) if a.tokenizer else None
    if tokenizer is None:
        from t1async.models import hf_tokenizers

        tokenizer = hf_tokenizers.tokenizer_folder("qwen3.5")
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    out.mkdir(parents=True, exist_ok=True)
    res = run(out, tokenizer, steps=a.steps, more_steps=a.more_steps, first=a.layout, second=a.resume_layout,
              timeout_s=a.timeout_s, overrides=a.overrides)
    print(json.dumps(res))
    return 0 if ok(res, a.steps, a.more_steps) else 1


if __name__ == "__main__":
    sys.exit(main())
