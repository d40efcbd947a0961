"""Train the shipped byte-level BPE tokenizer (``t1async/assets/tokenizer.json``) offline.

Usage::

    python tools/train_tokenizer.py [--out t1async/assets/tokenizer.json] [--vocab-size 4096]

Sources (all present on a Debian machine with Python, no downloads), biased toward shell:

1. Shell scripts (weight 4): files under /usr/bin, /usr/sbin, /usr/lib, /usr/share, /etc
   whose first line is a ``#!`` for sh/bash/dash/zsh, ``*.sh``/``*.bash`` files, bash-completion
   scripts and shell rc files (bashrc, profile); plus the shipped
   tasks' ``instruction.md``, ``solution/solve.sh`` and ``tests/test.sh`` under t1async/envs/tasks.
2. English manual pages (weight 1): /usr/share/man/man1 and man8 (commands), then man5/man7,
   decompressed with ``gzip`` and stripped of roff/mdoc markup to approximate rendered text.
3. Python standard-library sources (weight 1): ``sysconfig.get_paths()["stdlib"]`` without
   site-packages, capped.
4. Plain-text docs under /usr/share/doc (``*.md``, ``*.txt``, ``*.rst``, ``README*``), capped.

Each source is read in sorted path order and capped in bytes, so reruns on the same machine
give the same corpus. The output is deterministic only up to tie-breaking inside the
``tokenizers`` BPE trainer (equally frequent pairs are ordered by a randomly seeded hash map,
even single-threaded): two runs share ~99% of tokens but assign many ids differently. The
shipped asset is therefore the reference: regenerating it changes token ids and invalidates
every checkpoint trained with the old one. Training takes 15-30 s on 2 cores.

Tokenizer: byte-level BPE (Radford et al. 2019, GPT-2 pre-tokenizer regex, no prefix space)
trained with the ``tokenizers`` library; vocabulary ``--vocab-size`` including the four special
tokens ``<|endoftext|>`` (id 0), ``<|im_start|>``, ``<|im_end|>``, ``<|pad|>`` (ids 1..3); the
tool-call special tokens ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
``</tool_response>`` are appended after training (ids ``--vocab-size`` .. ``--vocab-size`` + 3), so
adding them never moved an earlier id (the shipped asset got them that way, ids 4096..4099).
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20
MAX_FILE = 256 * 1024  # skip larger single files (generated data, bundled blobs)

_RC_NAMES = {"bashrc", "bash.bashrc", ".bashrc", "dot.bashrc", "profile", ".profile", "dot.profile"}
_SHEBANG = re.compile(rb"^#!\s*\S*(?:/|env\s+)(?:ba|da|z|k)?sh\b")
_ROFF_ESC = [
    (re.compile(r"\\f(?:\(..|\[[^\]]*\]|.)"), ""),  # font changes
    (re.compile(r"\\\((?:aq|cq)"), "'"),
    (re.compile(r"\\\((?:dq|lq|rq)"), '"'),
    (re.compile(r"\\\((?:em|en|hy|mi)"), "-"),
    (re.compile(r"\\\[(?:aq)\]"), "'"),
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\e"), "\\\\"),
    (re.compile(r"\\[&|^%:,/0dut]"), ""),  # zero-width and motion escapes
    (re.compile(r"\\ "), " "),
    (re.compile(r"\\\*(?:\(..|\[[^\]]*\]|.)"), ""),  # strings
    (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),  # other glyphs
    (re.compile(r"\\s[-+]?\d"), ""),  # size changes
]


def roff_to_text(src: str) -> str:
    """Approximate the rendered text of a man/mdoc page: drop comments and requests, keep the
    arguments of font macros (``.B``, ``.IR``, ``.Fl``...), remove inline escapes."""
    out = []
    for line in src.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.\\}', "'.")) or line.strip() in (".", "'"):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].split(None, 1)
            if not parts:
                continue
            macro, rest = parts[0], (parts[1] if len(parts) > 1 else "")
            if macro == "Fl":  # mdoc flag: ".Fl n" renders "-n"
                rest = "-" + rest
            elif macro in ("TH", "so", "ds", "de", "nr", "if", "ie", "el", "ig", "ft", "ne",
                           "sp", "br", "PP", "LP", "P", "fi", "nf", "in", "ti", "na", "ad",
                           "hy", "nh", "Dd", "Dt", "Os", "RS", "RE", "TS", "TE", "EX", "EE"):
                if macro in ("sp", "PP", "LP", "P"):
                    out.append("")
                continue
            line = rest.replace('"', "")
        for pat, rep in _ROFF_ESC:
            line = pat.sub(rep, line)
        out.append(line)
    return "\n".join(out).strip() + "\n"


def _read(path: Path) -> bytes | None:
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_FILE:
            return None
        return path.read_bytes()
    except OSError:
        return None


def _text(data: bytes) -> str | None:
    if b"\0" in data[:4096]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _walk(roots: list[str]) -> Iterator[Path]:
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
            for f in sorted(filenames):
                yield Path(dirpath) / f


def _capped(docs: Iterator[str], cap: int) -> Iterator[str]:
    total = 0
    for d in docs:
        if total >= cap:
            return
        total += len(d.encode())
        yield d


def shell_scripts() -> Iterator[str]:
    roots = ["/usr/bin", "/usr/sbin", "/usr/lib", "/usr/share", "/etc", str(REPO / "envs")]
    for p in _walk(roots):
        data = _read(p)
        if data is None:
            continue
        is_task = str(p).startswith(str(REPO / "envs"))
        shellish = (p.suffix in (".sh", ".bash", ".zsh") or p.name in _RC_NAMES
                    or "/bash-completion/" in str(p) or _SHEBANG.match(data))
        if shellish or (is_task and p.suffix in (".md", ".py")):
            t = _text(data)
            if t:
                yield t


def man_pages() -> Iterator[str]:
    for sec in ("man1", "man8", "man5", "man7"):
        for p in sorted(Path("/usr/share/man", sec).glob("*.gz")):
            try:
                if p.is_symlink():
                    continue
                t = _text(gzip.decompress(p.read_bytes()))
            except (OSError, EOFError, gzip.BadGzipFile):
                continue
            if t:
                yield roff_to_text(t)


def python_stdlib() -> Iterator[str]:
    for p in _walk([sysconfig.get_paths()["stdlib"]]):
        if p.suffix == ".py" and "/test/" not in str(p):
            data = _read(p)
            t = data and _text(data)
            if t:
                yield t


def docs() -> Iterator[str]:
    for p in _walk(["/usr/share/doc"]):
        if p.suffix in (".md", ".txt", ".rst") or p.name.startswith("README") and not p.suffix:
            data = _read(p)
            t = data and _text(data)
            if t:
                yield t


def corpus(scale_mb: float = 1.0) -> Iterator[str]:
    """The training documents, in a fixed order; byte caps scale with ``scale_mb``."""
    shell = list(_capped(shell_scripts(), int(12 * MB * scale_mb)))
    print(f"shell scripts: {len(shell)} files, {sum(map(len, shell)) / MB:.1f} MB (x4)", file=sys.stderr)
    for _ in range(4):
        yield from shell
    for name, gen, cap in (("man pages", man_pages(), 16), ("python stdlib", python_stdlib(), 12),
                           ("docs", docs(), 4)):
        n = size = 0
        for d in _capped(gen, int(cap * MB * scale_mb)):
            n, size = n + 1, size + len(d)
            yield d
        print(f"{name}: {n} files, {size / MB:.1f} MB", file=sys.stderr)


def build_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer with this project's pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train(vocab_size: int = 4096, scale_mb: float = 1.0) -> Tokenizer:
    """Train on :func:`corpus`; the special tokens get ids 0..3 and are registered as special."""
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(scale_mb), trainer=trainer)
    return tok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "t1async" / "assets" / "tokenizer.json"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every source's byte cap")
    args = ap.parse_args(argv)
    tok = train(args.vocab_size, args.scale)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    base = tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens(TOOL_TOKENS)  # appended: every id above stays where training put it
    for i, s in enumerate(TOOL_TOKENS):
        assert tok.token_to_id(s) == base + i, (s, tok.token_to_id(s))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out, pretty=False)
    print(f"wrote {args.out}: vocab {tok.get_vocab_size()}, {Path(args.out).stat().st_size / 1024:.0f} KiB",
          file=sys.stderr)


if __name__ == "__main__":
    main()
