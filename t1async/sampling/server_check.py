"""Launch-time check that an SGLang server serves the learner's model (started by launch or attached).

What a server exposes, and so what is checked (SGLang 0.5.x ``http_server.py``):

- ``GET /model_info``: ``model_path``, ``is_generation``, ``model_type``, ``architectures``, ``weight_version``.
  Checked: ``is_generation`` is true and ``model_type`` equals the learner folder's config.json ``model_type``.
- ``GET /server_info``: the server arguments (``model_path``, ``tp_size``, ``skip_tokenizer_init``,
  ``enable_return_routed_experts``, ...) and scheduler state. No vocabulary size and no end ids: SGLang
  reads them from the folder it was started with and does not report them over HTTP.
  Checked: ``skip_tokenizer_init`` and ``enable_return_routed_experts`` are on (t1async sends token ids and
  refuses answers without routing). When the server's ``model_path`` is a folder readable here (always
  for servers launch starts), its config.json ``vocab_size`` and generation_config.json ``eos_token_id``
  are compared with the learner's; otherwise (a hub id, another machine's path) they are logged as
  unchecked.
  The architecture keys that fix the names and shapes of the weights the sync sends
  (``num_hidden_layers``, ``hidden_size``, experts, top-k, expert width) are compared the same way.
- ``POST /get_weights_by_name`` (``{"name", "truncate_size"}``): 200 with values for a parameter the
  model has, 400 ``Get parameter by name failed`` for one it does not. SGLang has no endpoint listing
  parameter names, and it fuses some (q/k/v, gate/up, the experts) under its own names, so only names
  that are the same in the Hugging Face layout the weight sync sends and in SGLang's modules are
  probed: the embedding, the final norm, the first and last layer's input norm, and ``lm_head`` when
  untied. SGLang 0.5.10.post1 implements the lookup only for a few dense models (llama, granite,
  exaone4, opt; ``ModelRunner.get_weights_by_name`` answers None otherwise), not for ``qwen3_moe``,
  ``qwen3_5_moe`` or ``glm4_moe``: a server that does not know even the embedding is taken as one
  without the lookup, and the names are logged as unchecked. One that knows the embedding but not
  another probed name is refused (a missing last-layer norm: fewer layers).

A mismatch raises :class:`~t1async.config.ConfigError` with one line naming the server, the field, both
values and what to do.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from loguru import logger

from t1async.config import ConfigError
from t1async.config.model_folder import decoder_config, model_type_of
from t1async.sampling.sampler_client import SamplerError, post_json

__all__ = ["folder_facts", "probe_names", "check_server", "check_servers"]

ARCH_KEYS = ("num_hidden_layers", "hidden_size", "num_experts", "n_routed_experts", "num_experts_per_tok",
             "moe_intermediate_size")
"""config.json keys (text decoder) that fix the weight names and shapes the sync sends."""

_PROBE = re.compile(r"^(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|"
                    r"model\.layers\.(\d+)\.input_layernorm\.weight)$")


def _read_json(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def weight_names(folder: Path) -> list[str]:
    """Parameter names of a Hugging Face folder's safetensors weights (the index's ``weight_map``, else
    the ``model.safetensors`` header: an 8-byte little-endian length, then JSON). Empty when neither
    is readable. No tensor is read."""
    index = _read_json(folder / "model.safetensors.index.json")
    if index and isinstance(index.get("weight_map"), dict):
        return sorted(index["weight_map"])
    try:
        with open(folder / "model.safetensors", "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return []
    return sorted(k for k in header if k != "__metadata__")


def folder_facts(folder: str | Path) -> dict[str, Any] | None:
    """What a model folder says a server must match, or None when ``folder`` has no readable config.json.

    Returns:
        ``{"model_type": str, "vocab_size": int | None, "eos_token_id": sorted list[int] | None,
        "weight_names": list[str], ARCH_KEYS...: value or None}`` (config.json's own ``model_type``, as
        SGLang reports it; the text decoder's other keys; generation_config.json; safetensors names).
    """
    folder = Path(folder).expanduser()
    raw = _read_json(folder / "config.json")
    if raw is None:
        return None
    d = decoder_config(raw)  # num_experts under whichever name its transformers version wrote
    gen = _read_json(folder / "generation_config.json") or {}
    eos = gen.get("eos_token_id", d.get("eos_token_id"))
    eos_ids = sorted(int(e) for e in (eos if isinstance(eos, list) else [eos])) if eos is not None else None
    vocab = d.get("vocab_size")
    return {"model_type": raw.get("model_type") or model_type_of(raw), "vocab_size": int(vocab) if vocab is not None else None,
            "eos_token_id": eos_ids, "weight_names": weight_names(folder), **{k: d.get(k) for k in ARCH_KEYS}}


def probe_names(names: list[str]) -> list[str]:
    """The names of ``names`` (a Hugging Face layout) that SGLang's modules keep unfused: embedding (first),
    final norm, ``lm_head``, and the input norm of the first and last layer; otherwise in ``names``' order."""
    layers = sorted({int(m.group(2)) for n in names if (m := _PROBE.match(n)) and m.group(2) is not None})
    keep = {f"model.layers.{i}.input_layernorm.weight" for i in (layers[:1] + layers[-1:])}
    out = [n for n in names if _PROBE.match(n) and (n in keep or ".layers." not in n)]
    return sorted(out, key=lambda n: n != "model.embed_tokens.weight")  # the embedding first: every model has it


def _refuse(url: str, field: str, server: Any, learner: Any, fix: str) -> None:
    raise ConfigError(f"SGLang server {url} reports {field}={server!r} but the learner's model has {learner!r}: {fix}")


def check_server(url: str, learner: dict[str, Any], *, timeout_s: float = 30.0) -> None:
    """Refuse a server whose model is not the learner's (see the module docstring for what is checked).

    Args:
        url: the server's base URL.
        learner: :func:`folder_facts` of the learner's model folder (``model.path`` or the resumed checkpoint).
        timeout_s: per request.

    Raises:
        ConfigError: one line naming the server, the field, both values and the fix.
        SamplerError: the server did not answer ``/model_info`` or ``/server_info``.
    """
    fix = "start it with --model-path set to the learner's model folder (model.path), or drop it from sampler.urls"
    info = post_json(url, "/model_info", method="GET", timeout_s=timeout_s)
    if info.get("is_generation") is False:
        _refuse(url, "is_generation", False, True, fix)
    if info.get("model_type") is not None and info["model_type"] != learner["model_type"]:
        _refuse(url, "model_type", info["model_type"], learner["model_type"], fix)
    args = post_json(url, "/server_info", method="GET", timeout_s=timeout_s)
    for flag in ("skip_tokenizer_init", "enable_return_routed_experts"):
        if args.get(flag) is False:
            raise ConfigError(f"SGLang server {url} runs without --{flag.replace('_', '-')}: restart it with that flag "
                              "(t1async sends token ids and needs the routed experts)")
    path = args.get("model_path") or info.get("model_path") or ""
    served = folder_facts(path) if path else None
    if served is None:
        logger.warning("SGLang server {}: its model_path {!r} is not a folder readable here, so its vocabulary size "
                       "and end ids are not checked against the learner's", url, path)
    else:
        for field in ("vocab_size", "eos_token_id", *ARCH_KEYS):
            if None not in (served[field], learner[field]) and served[field] != learner[field]:
                _refuse(url, field, served[field], learner[field], fix)
    names = probe_names(learner["weight_names"])
    for i, name in enumerate(names):
        try:
            post_json(url, "/get_weights_by_name", {"name": name, "truncate_size": 1}, timeout_s=timeout_s)
        except SamplerError as e:
            if "HTTP 400" not in str(e):
                raise
            if i == 0:  # not even the embedding: this model has no get_weights_by_name in SGLang
                logger.warning("SGLang server {} answers no get_weights_by_name for {} (SGLang implements it for a few "
                               "dense models only): weight names unchecked", url, name)
                return
            raise ConfigError(f"SGLang server {url} has no parameter {name} (get_weights_by_name failed), which the "
                              f"learner's weight sync sends: {fix}") from None


def check_servers(urls: list[str], learner_folder: str | Path, *, timeout_s: float = 30.0) -> None:
    """:func:`check_server` for each of ``urls`` against the folder the learner builds its model from.

    Raises:
        ConfigError: ``learner_folder`` has no readable config.json, or a server does not match.
    """
    learner = folder_facts(learner_folder)
    if learner is None:
        raise ConfigError(f"{learner_folder} has no readable config.json: give model.path a Hugging Face model folder")
    for url in urls:
        check_server(url, learner, timeout_s=timeout_s)
    logger.info("SGLang servers {} serve the learner's model ({}, vocab {}, end ids {}, {} weight names probed)", urls,
                learner["model_type"], learner["vocab_size"], learner["eos_token_id"],
                len(probe_names(learner["weight_names"])))
