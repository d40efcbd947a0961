"""``t1async model init|check``: write a random-weight Hugging Face model folder; check one before a run.

    t1async model init --family qwen3_moe --tokenizer TOKDIR --out DIR [hidden_size=64 ...]
    t1async model check DIR

``init`` writes what a Hub checkpoint holds (config.json, safetensors weights, the tokenizer files, chat
template and generation_config.json of ``--tokenizer``), small enough to train on 2 cores, so a real
tokenizer and template can be exercised end to end without downloading weights:
``t1async launch configs/local.yaml model.path=DIR``. Size keys are the family's config.json names; the
vocabulary is the tokenizer's size rounded up to a multiple of 64 unless ``vocab_size=`` says otherwise.
Tokenizer folders with real vocabularies and templates: ``python tools/hf_tokenizers.py`` (offline).

``check`` runs every check of ``model.path`` that needs no weights read (t1async/models/families.py
:func:`check_model_folder`) and prints the facts as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from t1async.config import ConfigError, EnvConfig, ModelConfig
from t1async.config.model_folder import resolve_model
from t1async.rollout.conversation import TemplateConversation

__all__ = ["register", "init_folder", "TINY"]

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "max_position_embeddings": 4096,
        "tie_word_embeddings": True}
"""Default sizes of ``model init`` (family config.json names; a family maps them onto its own keys)."""


def _value(text: str):
    """A size value from the command line: JSON (numbers, true/false, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def init_folder(family: str, tokenizer: str | Path, out: str | Path, sizes: dict | None = None, *, seed: int = 0) -> Path:
    """Write a random-weight model folder of ``family`` with the tokenizer files of ``tokenizer``.

    Args:
        family: a ``model_type`` (t1async/models/families.py :data:`FAMILIES`).
        tokenizer: a folder with tokenizer.json, tokenizer_config.json (a chat template in it or in
            chat_template.jinja) and, ideally, generation_config.json.
        out: the folder to write (must not hold a config.json already).
        sizes: config.json keys over :data:`TINY`.
        seed: torch seed of the weights.

    Returns:
        ``out``.

    Raises:
        ConfigError (ModelFolderError): an unknown family, a tokenizer folder without its files or with a
            template that cannot render a tool turn, ``vocab_size`` below the tokenizer's size, ``out`` already
            a model folder, or sizes the family refuses.
    """
    import torch  # (torch, transformers: deferred, so `t1async --help` stays fast)

    # (torch, transformers: as above)
    from t1async.models.families import FAMILIES, build_model, check_model_folder, load_renderer, save_model
    from t1async.models.hf_folder import ModelFolderError, copy_tokenizer_files  # (torch: as above)

    if family not in FAMILIES:
        raise ModelFolderError(f"--family {family!r} is not one t1async implements; use one of {', '.join(sorted(FAMILIES))}")
    out = Path(out)
    if (out / "config.json").exists():
        raise ModelFolderError(f"--out {out} already holds a model (config.json); give a new folder")
    renderer = load_renderer(ModelConfig(path=str(tokenizer), hf_config={"model_type": family}))
    sizes = {**TINY, **(sizes or {})}
    vocab = int(sizes.pop("vocab_size", 0) or -(-renderer.vocab_size // 64) * 64)
    if vocab < renderer.vocab_size:
        raise ModelFolderError(f"vocab_size={vocab} is smaller than the tokenizer's {renderer.vocab_size} ids; "
                               f"use vocab_size >= {renderer.vocab_size} or drop it")
    config = FAMILIES[family].init_config({**sizes, "vocab_size": vocab}, renderer)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_tokenizer_files(tokenizer, out)
    if not (out / "generation_config.json").exists():
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": renderer.end_of_turn_ids}) + "\n")
    cfg = resolve_model(ModelConfig(path=str(out)))
    torch.manual_seed(seed)
    model = build_model(cfg)
    save_model(out, cfg, model)
    check_model_folder(cfg)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    """``t1async model init|check``."""
    p = sub.add_parser("model", help="write a tiny random-weight Hugging Face model folder, or check one")
    msub = p.add_subparsers(dest="model_command", required=True)
    i = msub.add_parser("init", help="write a random-weight model folder with a real tokenizer and chat template")
    i.add_argument("--family", required=True, help="model_type: qwen3_moe, qwen3_5_moe, glm4_moe")
    i.add_argument("--tokenizer", required=True, help="tokenizer folder (tokenizer.json, tokenizer_config.json, "
                                                      "chat template); python tools/hf_tokenizers.py builds real ones")
    i.add_argument("--out", required=True, help="model folder to write")
    i.add_argument("--seed", type=int, default=0, help="torch seed of the weights")
    i.add_argument("sizes", nargs="*", default=[], help="config.json keys, e.g. hidden_size=128 num_experts=8")
    i.set_defaults(func=run_init)
    c = msub.add_parser("check", help="check a model folder (config, weights' names and shapes, tokenizer, "
                                      "template, memory) without reading the weights")
    c.add_argument("path", help="model folder")
    c.add_argument("--chat-template-kwargs", default="{}", metavar="JSON",
                   help="model.chat_template_kwargs as JSON, e.g. '{\"enable_thinking\": false}': the printed "
                        "tool_episode is rendered with them")
    c.set_defaults(func=run_check)


def run_init(args: argparse.Namespace) -> int:
    """Run ``model init``; prints the folder."""
    bad = [s for s in args.sizes if "=" not in s]
    if bad:
        raise ConfigError(f"size {bad[0]!r} is not key=value (for example hidden_size=128)")
    sizes = {k: _value(v) for k, v in (s.split("=", 1) for s in args.sizes)}
    print(init_folder(args.family, args.tokenizer, args.out, sizes, seed=args.seed))
    return 0


def run_check(args: argparse.Namespace) -> int:
    """Run ``model check``; prints the facts as one JSON object, with ``tool_episode``: the text of a two-turn
    tool episode as t1async renders it with ``--chat-template-kwargs`` (:func:`tool_episode`)."""
    from t1async.models.families import check_model_folder, load_renderer  # (torch, transformers: as in init_folder)

    try:
        kwargs = json.loads(args.chat_template_kwargs)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--chat-template-kwargs {args.chat_template_kwargs!r} is not JSON ({e}); "
                          "give an object, e.g. '{\"enable_thinking\": false}'") from None
    cfg = resolve_model(ModelConfig(path=args.path, chat_template_kwargs=kwargs))
    cfg.check("model")
    facts = check_model_folder(cfg)
    json.dump({"path": args.path, **facts, "chat_template_kwargs": kwargs,
               "tool_episode": tool_episode(load_renderer(cfg))}, sys.stdout)
    print()
    return 0


def tool_episode(renderer) -> str:
    """The text of a two-turn episode with ``env.action_format`` tool_call, built as ``t1async sft`` builds a
    demonstration and the rollout loop builds an episode (the same :class:`~t1async.rollout.conversation.
    TemplateConversation`; the turns are the template's own rendering of each bash call, then the end signal):
    the prompt with the tool declared, each call, each tool observation, the end signal. Special tokens are
    written as their strings.

    Raises:
        TemplateError, ValueError: the template cannot render a tool episode.
    """
    from t1async.commands.sft import template_demonstration_turns  # (torch: as in init_folder)

    env_cfg = EnvConfig(action_format="tool_call")
    instruction, commands, outputs = "Count the files in /app.", ["ls /app", "ls /app | wc -l"], ["a.txt\nb.txt", "2"]
    conv = TemplateConversation(renderer, env_cfg, instruction)
    stream = list(conv.prompt)
    for turn, output in zip(template_demonstration_turns(renderer, env_cfg, instruction, commands), [*outputs, None]):
        stream += turn
        action = conv.assistant_turn(turn)
        if output is not None and not action.end:
            stream += conv.observation(output, stream)
    return renderer.decode(stream)
