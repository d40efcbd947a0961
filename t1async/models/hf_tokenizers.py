"""Build real Hugging Face tokenizer folders offline, for tests and tiny models on CPU.

No model hub is reachable from the project's machines, but a registry package carries what is needed:
the source archive of ``llama-cpp-python`` (version :data:`SDIST_VERSION`, about 76 MB, downloaded with
``pip download --no-deps --no-binary :all:``; nothing is built or installed) holds
``vendor/llama.cpp/models/ggml-vocab-qwen2.gguf`` (the Qwen2/Qwen3 byte-level BPE vocabulary, 151,936 ids with
``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``, ``<think>`` and the other added tokens) and
``vendor/llama.cpp/models/templates/*.jinja`` (the chat templates of about 80 models). This tool

1. downloads the archive once into ``CACHE/sdist/`` (``CACHE`` is ``$T1ASYNC_HF_CACHE`` or
   ``~/.cache/t1async/hf-tokenizers``),
2. extracts the vocabulary file and the templates into ``CACHE/src/``,
3. converts the vocabulary once with ``transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)``
   (needs the ``gguf`` package; about 60 s on a busy 2-core machine) and saves it as ``CACHE/qwen2-vocab/``,
4. writes one folder per template (:data:`FOLDERS`): the converted vocabulary, ``chat_template`` set from the
   ``.jinja`` file, any special tokens that template needs and the vocabulary lacks (GLM's role tokens), and a
   ``generation_config.json`` whose ``eos_token_id`` lists the end-of-turn ids.

Each step is skipped when its output is already there, so a warm call takes well under a second. The files
are a third party's: they stay in the cache, outside the repository, and none is committed.

CLI: ``python tools/hf_tokenizers.py [--out DIR] [--names qwen3 glm-4.6 ...]`` (a thin script over :func:`main`)
prints one folder a line; ``t1async model init --tokenizer FOLDER`` takes one. Tests call
:func:`tokenizer_folder` (or :func:`build_folders`) and skip with the :class:`Unavailable` message when the
archive or the ``gguf`` package cannot be had.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
"""The ``llama-cpp-python`` source archive the files come from (pinned: the test fixtures must not move)."""
_PREFIX = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/models/"
VOCAB_FILE = "ggml-vocab-qwen2.gguf"
QWEN3_ADDED = ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
               "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
               "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
               "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
               "</think>")
"""Qwen3's added tokens at ids 151646.. in order. The GGUF vocabulary names only ``<|endoftext|>``,
``<|im_start|>`` and ``<|im_end|>`` (151643..151645) and calls every later id ``[PAD<id>]``; the conversion
gives those placeholders their Qwen3 names at the same ids, so ``<tool_call>`` is 151657 and ``<think>``
151667 as in a real Qwen3 folder."""
_QWEN3_NOT_SPECIAL = 151657
"""From this id on the Qwen3 added tokens are not ``special`` (``decode(skip_special_tokens=True)`` keeps them)."""


@dataclass(frozen=True)
class FolderSpec:
    """One tokenizer folder: a template from the archive on the Qwen2/Qwen3 vocabulary.

    Attributes:
        template: file name under ``models/templates/`` in the archive.
        added_special: special tokens the template writes that the Qwen vocabulary lacks; appended as new ids.
        eos: end-of-turn tokens, in order, written to ``generation_config.json`` as ``eos_token_id``
            (the first is the one a truncated turn is closed with).
    """

    template: str
    added_special: tuple[str, ...] = ()
    eos: tuple[str, ...] = field(default=("<|im_end|>", "<|endoftext|>"))


FOLDERS: dict[str, FolderSpec] = {
    "qwen3": FolderSpec("Qwen-Qwen3-0.6B.jinja"),
    "qwen3-coder": FolderSpec("Qwen3-Coder.jinja"),
    "qwen3.5": FolderSpec("Qwen3.5-4B.jinja"),
    # GLM-4.6's template on the Qwen vocabulary (fine for template tests): its role tokens become added ids,
    # and a turn ends where the model writes the next role, as GLM's own generation_config says
    "glm-4.6": FolderSpec("GLM-4.6.jinja",
                          added_special=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                                         "<|observation|>"),
                          eos=("<|observation|>", "<|user|>", "<|endoftext|>")),
}
"""Folder name -> what it is built from. ``--names`` picks among these."""


class Unavailable(RuntimeError):
    """The folders cannot be built here (archive not downloadable, ``gguf`` or ``transformers`` missing);
    the message says which and what to do. Tests ``pytest.skip`` with it."""


def cache_dir() -> Path:
    """``$T1ASYNC_HF_CACHE`` when set, else ``~/.cache/t1async/hf-tokenizers``."""
    env = os.environ.get("T1ASYNC_HF_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "t1async" / "hf-tokenizers"


def _sdist(cache: Path) -> Path:
    """The downloaded archive, fetched with pip on first use.

    Raises:
        Unavailable: pip could not download it (no registry reachable, version withdrawn).
    """
    d = cache / "sdist"
    name = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if (d / name).is_file():
        return d / name
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"{SDIST}=={SDIST_VERSION}", "-d", str(d)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"`{' '.join(cmd)}` did not finish: {e}") from None
    if r.returncode != 0 or not (d / name).is_file():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Unavailable(f"could not download the {SDIST}=={SDIST_VERSION} source archive the real tokenizers come "
                          f"from ({tail[0]}); run `{' '.join(cmd)}` where the package registry is reachable")
    return d / name


def _sources(cache: Path) -> Path:
    """``CACHE/src/`` with the vocabulary file and ``templates/*.jinja``, extracted once."""
    src = cache / "src"
    if (src / VOCAB_FILE).is_file() and (src / "templates").is_dir():
        return src
    archive = _sdist(cache)
    tmp = cache / "src.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "templates").mkdir(parents=True)
    with tarfile.open(archive, "r:gz") as tar:
        for m in tar.getmembers():
            if not m.isfile() or not m.name.startswith(_PREFIX):
                continue
            rel = m.name[len(_PREFIX):]
            if rel == VOCAB_FILE or (rel.startswith("templates/") and rel.endswith(".jinja") and rel.count("/") == 1):
                (tmp / rel).write_bytes(tar.extractfile(m).read())
    if not (tmp / VOCAB_FILE).is_file():
        raise Unavailable(f"{archive} has no {_PREFIX}{VOCAB_FILE}; delete it and rerun")
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)
    return src


def _vocab(cache: Path):
    """The converted Qwen2/Qwen3 fast tokenizer (``CACHE/qwen2-vocab/``, converted from GGUF once)."""
    try:
        from transformers import AutoTokenizer  # transformers: heavy to import, a test extra
    except ImportError:
        raise Unavailable("transformers is not installed; pip install -e '.[test]'") from None
    out = cache / "qwen2-vocab"
    if not (out / "tokenizer.json").is_file():
        try:
            import gguf  # noqa: F401  (transformers' GGUF reader needs it)
        except ImportError:
            raise Unavailable("the gguf package is not installed (it converts the GGUF vocabulary); "
                              "pip install -e '.[test]'") from None
        src = _sources(cache)
        tok = AutoTokenizer.from_pretrained(str(src), gguf_file=VOCAB_FILE)
        tmp = cache / "qwen2-vocab.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(str(tmp))
        _name_qwen3_added(tmp / "tokenizer.json")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return AutoTokenizer.from_pretrained(str(out))


def _name_qwen3_added(path: Path) -> None:
    """Rename the ``[PAD<id>]`` placeholders at ids 151646.. of a converted ``tokenizer.json`` to
    :data:`QWEN3_ADDED` (in ``added_tokens`` and the BPE vocabulary).

    Raises:
        Unavailable: the file does not hold the placeholders where expected (a different vocabulary file).
    """
    j = json.loads(path.read_text("utf-8"))
    by_id = {a["id"]: a for a in j["added_tokens"]}
    vocab = j["model"]["vocab"]
    for k, name in enumerate(QWEN3_ADDED):
        i = 151646 + k
        a = by_id.get(i)
        if a is None or a["content"] != f"[PAD{i}]" or vocab.get(a["content"]) != i:
            raise Unavailable(f"{path}: id {i} is {a and a['content']!r}, not the placeholder [PAD{i}] this tool "
                              f"renames; is {VOCAB_FILE} the Qwen2 vocabulary of {SDIST}=={SDIST_VERSION}?")
        del vocab[a["content"]]
        vocab[name] = i
        a["content"] = name
        a["special"] = i < _QWEN3_NOT_SPECIAL
    path.write_text(json.dumps(j, ensure_ascii=False), "utf-8")


def build_folders(names: list[str] | None = None, out: str | Path | None = None) -> dict[str, Path]:
    """Build (or find already built) the tokenizer folders ``names`` (default all of :data:`FOLDERS`).

    Args:
        names: keys of :data:`FOLDERS`.
        out: where the folders go (default :func:`cache_dir`); the archive and the converted vocabulary
            always stay in :func:`cache_dir`.

    Returns:
        name -> folder holding ``tokenizer.json``, ``tokenizer_config.json`` (with ``chat_template``),
        ``chat_template.jinja`` and ``generation_config.json``.

    Raises:
        ValueError: an unknown name (the known ones are listed).
        Unavailable: the archive, ``transformers`` or ``gguf`` cannot be had.
    """
    names = list(FOLDERS) if names is None else list(names)
    bad = [n for n in names if n not in FOLDERS]
    if bad:
        raise ValueError(f"unknown tokenizer folder(s) {bad}; known: {sorted(FOLDERS)}")
    cache = cache_dir()
    out_dir = Path(out).expanduser() if out is not None else cache
    done = {n: out_dir / n for n in names if (out_dir / n / "generation_config.json").is_file()}
    if len(done) == len(names):
        return done
    vocab = None
    for n in names:
        if n in done:
            continue
        if vocab is None:
            vocab = _vocab(cache)
        spec = FOLDERS[n]
        template = (_sources(cache) / "templates" / spec.template).read_text("utf-8")
        tok = vocab.__class__.from_pretrained(str(cache / "qwen2-vocab"))
        if spec.added_special:
            tok.add_special_tokens({"additional_special_tokens": list(spec.added_special)})
        tok.chat_template = template
        eos_ids = [tok.convert_tokens_to_ids(t) for t in spec.eos]
        if any(i is None or i == tok.unk_token_id for i in eos_ids):
            raise RuntimeError(f"{n}: an end-of-turn token of {spec.eos} is not in the vocabulary")
        tmp = out_dir / f"{n}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(str(tmp))
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}, indent=2) + "\n")
        shutil.rmtree(out_dir / n, ignore_errors=True)
        tmp.rename(out_dir / n)
        done[n] = out_dir / n
    return {n: done[n] for n in names}


def tokenizer_folder(name: str) -> Path:
    """The folder of one tokenizer ``name`` (a key of :data:`FOLDERS`), built on first use.

    Raises:
        ValueError: unknown name. Unavailable: see :func:`build_folders`.
    """
    return build_folders([name])[name]


def main(argv: list[str] | None = None) -> int:
    """CLI entry: build the folders and print ``NAME<TAB>PATH`` a line; exit 2 with the reason when they
    cannot be built."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="where the folders go (default the cache, $T1ASYNC_HF_CACHE or "
                   "~/.cache/t1async/hf-tokenizers)")
    p.add_argument("--names", nargs="+", default=None, choices=sorted(FOLDERS), help="folders to build (default all)")
    a = p.parse_args(argv)
    try:
        folders = build_folders(a.names, a.out)
    except Unavailable as e:
        print(f"hf_tokenizers: {e}", file=sys.stderr)
        return 2
    for n, d in folders.items():
        print(f"{n}\t{d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
