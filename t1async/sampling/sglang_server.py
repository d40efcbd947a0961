"""Sampler backend ``sglang``: start one ``python -m sglang.launch_server`` per sampler, or attach to ``sampler.urls``.

Started servers run on this (the launch) machine: sampler i gets GPUs ``i*tp .. (i+1)*tp - 1``
(``CUDA_VISIBLE_DEVICES``), a free port on ``sampler.host``, ``--enable-return-routed-experts``
(without it SGLang silently omits routing, which the client refuses), ``--skip-tokenizer-init``
(t1async sends token ids and reads ``output_ids``) and ``--weight-version -1`` (no weights from the
learner yet), and writes ``RUN_DIR/logs/sglang{i}.log``. Launch waits until every server answers
``GET /health`` with 200 (at most ``sampler.start_timeout_s``) and stops them at exit.

Attached servers (``sampler.urls``) are health-checked; start them with the same flags. With
``model.path`` every server, started or attached, is then checked against the learner's model folder
(t1async/sampling/server_check.py: model type, vocabulary size, end ids, weight names); launch starts
servers with ``--model-path`` = ``model.path``, or on a resume the newest intact checkpoint.

Log-probs: a server reports the drawn token's ``log_softmax(logits / T)`` over the whole vocabulary,
not renormalised over its top-k / top-p set; the learner scores that same quantity
(t1async/models/logprobs.py ``SGLANG``). The server environment variable
``SGLANG_RETURN_ORIGINAL_LOGPROB`` would make it untempered: :func:`check_logprob_env` refuses it.

Source: SGLang 0.5.10.post1 ``server_args.py`` flags, ``http_server.py`` ``/health``,
``layers/sampler.py`` log-probs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from loguru import logger

from t1async.config import ConfigError, SamplerConfig
from t1async.sampling.sampler_client import SamplerError, post_json
from t1async.sampling.server_check import check_servers
from t1async.transport.ports import free_port


class SGLangStartError(RuntimeError):
    """A server did not start or did not become healthy in time."""


def sglang_command(cfg: SamplerConfig, port: int, model_path: str = "") -> list[str]:
    """The ``sglang.launch_server`` command line of one sampler (``--model-path``: ``model_path``, else
    ``cfg.model_path``)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path or cfg.model_path, "--host", cfg.host,
            "--port", str(port), "--tp-size", str(cfg.tp_size), "--enable-return-routed-experts",
            "--skip-tokenizer-init", "--weight-version", "-1", *cfg.extra_args]


def check_logprob_env(temperature: float, environ: Mapping[str, str] | None = None) -> None:
    """Refuse ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (true or 1, SGLang's reading) in the environment the
    servers inherit at a temperature other than 1: SGLang then reports ``log_softmax(logits)``
    (untempered), a distribution the tokens were not drawn from and the learner does not score.

    Args:
        temperature: ``generation.temperature``.
        environ: the environment (default ``os.environ``, which started servers inherit).

    Raises:
        ConfigError: one line naming the variable, the temperature and the fix.
    """
    value = (os.environ if environ is None else environ).get("SGLANG_RETURN_ORIGINAL_LOGPROB", "")
    if value.lower() in ("1", "true") and temperature != 1.0:
        raise ConfigError(f"SGLANG_RETURN_ORIGINAL_LOGPROB={value} makes SGLang report untempered log-probs, "
                          f"but generation.temperature={temperature}: unset it (t1async scores the tempered softmax)")


def wait_healthy(urls: list[str], timeout_s: float, procs: list[subprocess.Popen] | None = None,
                 logs: list[Path] | None = None) -> None:
    """Wait until every url answers ``GET /health`` with 200.

    Raises:
        SGLangStartError: a started server exited, or not all were healthy within ``timeout_s``
            (the message names the url and the log to read).
    """
    deadline = time.monotonic() + timeout_s
    pending = list(range(len(urls)))
    while pending:
        for i in list(pending):
            if procs and procs[i].poll() is not None:
                raise SGLangStartError(f"SGLang server {urls[i]} exited with status {procs[i].returncode}; "
                                       f"see {logs[i] if logs else 'its log'}")
            try:
                post_json(urls[i], "/health", method="GET", timeout_s=5)
                pending.remove(i)
            except SamplerError:
                pass
        if pending and time.monotonic() > deadline:
            where = f"; see {[str(logs[i]) for i in pending]}" if logs else ""
            raise SGLangStartError(f"SGLang servers {[urls[i] for i in pending]} not healthy after {timeout_s:.0f} s "
                                   f"(sampler.start_timeout_s){where}")
        if pending:
            time.sleep(1.0)


def start_servers(cfg: SamplerConfig, run_dir: Path, learner_model: str = "") -> tuple[list[subprocess.Popen], list[str]]:
    """Start ``cfg.num_samplers`` servers (or attach to ``cfg.urls``), wait for their health and, given
    ``learner_model``, check each against it.

    Args:
        cfg: the sampler section.
        run_dir: the run directory (logs go to ``run_dir/logs``).
        learner_model: the Hugging Face folder the learner builds its model from (``model.path`` or the
            resumed checkpoint): started servers get it as ``--model-path``, and every server must match it
            (:func:`~t1async.sampling.server_check.check_servers`). Empty: ``cfg.model_path``, no check.

    Returns:
        (processes started, empty when attached; base URLs).

    Raises:
        SGLangStartError: see :func:`wait_healthy`; started servers are stopped first.
        ConfigError: a server does not serve the learner's model (one line; started servers are stopped first).
    """
    if cfg.urls:
        urls = [u.rstrip("/") for u in cfg.urls]
        wait_healthy(urls, cfg.start_timeout_s)
        if learner_model:
            check_servers(urls, learner_model)
        logger.info("attached to {} SGLang servers: {}", len(urls), urls)
        return [], urls
    procs, urls, logs = [], [], []
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    try:
        for i in range(cfg.num_samplers):
            port = free_port(cfg.host)
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(g) for g in range(i * cfg.tp_size,
                                                                                        (i + 1) * cfg.tp_size)))
            log = run_dir / "logs" / f"sglang{i}.log"
            with log.open("ab") as f:
                procs.append(subprocess.Popen(sglang_command(cfg, port, learner_model), stdout=f,
                                              stderr=subprocess.STDOUT, env=env, start_new_session=True))
            urls.append(f"http://{cfg.host}:{port}")
            logs.append(log)
        wait_healthy(urls, cfg.start_timeout_s, procs, logs)
        if learner_model:
            check_servers(urls, learner_model)
    except BaseException:
        stop_servers(procs)
        raise
    logger.info("started {} SGLang servers: {}", len(urls), urls)
    return procs, urls


def stop_servers(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM each server's process group, SIGKILL what is left after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
