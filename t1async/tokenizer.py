"""Byte-level BPE tokenizer with a ChatML chat template (Qwen style) for shell episodes.

The shipped asset ``t1async/assets/tokenizer.json`` is a 4096-entry byte-level BPE trained
offline by ``tools/train_tokenizer.py`` (man pages, shell scripts, Python stdlib, docs). Ids 0..3
are the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<|pad|>``.

Template (ChatML, as Qwen's chat models use; roles system/user/assistant/tool)::

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n

An observation is rendered *on its own* and appended after the assistant turn's ``<|im_end|>``::

    \\n<|im_start|>tool\\n{output}<|im_end|>\\n<|im_start|>assistant\\n

Special tokens are only ever inserted by the template, as ids: :meth:`ChatTokenizer.encode`
treats its input purely as text, so a model or a command that prints ``<|im_end|>`` gets the
ordinary byte-level tokens for those characters, never the special id (no template injection).
Each text piece between special tokens is encoded separately, which is exactly what a
special-token-aware tokenizer produces for the whole rendered string.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

__all__ = ["ChatTokenizer", "SPECIAL_TOKENS", "ROLES"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
ROLES = ("system", "user", "assistant", "tool")


class ChatTokenizer:
    """Text <-> ids for the policy, plus the chat template's token layout.

    Attributes:
        vocab_size: number of ids (special tokens included); the model's ``vocab_size`` must be
            at least this.
        im_start_id, im_end_id: ids of ``<|im_start|>`` / ``<|im_end|>``.
        eos_id: id of ``<|endoftext|>``.
        pad_id: id of ``<|pad|>`` (right padding in learner batches).

    Construct with :meth:`load`.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        """Wrap a ``tokenizers.Tokenizer`` that holds the four special tokens.

        Raises:
            ValueError: a special token is missing from the vocabulary.
        """
        self._tok = tokenizer
        self._tok.encode_special_tokens = True  # user text is text: never parse special tokens
        ids = {}
        for s in SPECIAL_TOKENS:
            i = tokenizer.token_to_id(s)
            if i is None:
                raise ValueError(f"tokenizer lacks the special token {s!r}")
            ids[s] = i
        self.eos_id = ids["<|endoftext|>"]
        self.im_start_id = ids["<|im_start|>"]
        self.im_end_id = ids["<|im_end|>"]
        self.pad_id = ids["<|pad|>"]
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._newline = self.encode("\n")
        self._assistant_header = [self.im_start_id, *self.encode("assistant\n")]

    @classmethod
    def load(cls, path: str | Path | None = None) -> "ChatTokenizer":
        """Load a ``tokenizer.json``; None loads the shipped asset (via importlib.resources).

        Raises:
            FileNotFoundError: ``path`` does not exist. ValueError: not a tokenizer with the
                four special tokens.
        """
        if path is None:
            text = resources.files("t1async").joinpath("assets/tokenizer.json").read_text("utf-8")
        else:
            text = Path(path).read_text("utf-8")
        try:
            json.loads(text)
            tok = Tokenizer.from_str(text)
        except Exception as e:  # json.JSONDecodeError, tokenizers' own Exception
            raise ValueError(f"{path or 'shipped tokenizer.json'} is not a tokenizers JSON file: {e}") from None
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as plain text: special-token strings inside it are NOT special ids."""
        if not text:
            return []
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are rendered as their strings (``<|im_end|>``...).

        Ids that split a multi-byte UTF-8 character decode to U+FFFD replacement characters.

        Raises:
            ValueError: an id outside [0, vocab_size).
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=False)

    def render_turn(self, role: str, content: str) -> list[int]:
        """``<|im_start|>{role}\\n{content}<|im_end|>`` as ids (no trailing newline).

        Raises:
            ValueError: ``role`` is not one of system/user/assistant/tool.
        """
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        return [self.im_start_id, *self.encode(f"{role}\n{content}"), self.im_end_id]

    def render_prompt(self, system: str, user: str) -> list[int]:
        """Episode opening: system turn, user turn, then the assistant header.

        ``<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n``
        ``<|im_start|>assistant\\n`` as ids; the sampler continues after it.
        """
        return [*self.render_turn("system", system), *self._newline,
                *self.render_turn("user", user), *self._newline, *self._assistant_header]

    def render_observation(self, output: str) -> list[int]:
        """A tool observation rendered on its own, to append after an assistant ``<|im_end|>``:

        ``\\n<|im_start|>tool\\n{output}<|im_end|>\\n<|im_start|>assistant\\n`` as ids
        (loss mask 0 in the episode stream).
        """
        return [*self._newline, *self.render_turn("tool", output), *self._newline,
                *self._assistant_header]

    @property
    def end_of_turn_ids(self) -> list[int]:
        """``[im_end_id]``: appended (loss mask 0) when a sampled turn did not end with it
        (drift repair), so the stream keeps the template's layout."""
        return [self.im_end_id]
