"""Real chat templates and tokenizers, loaded once per folder."""

from __future__ import annotations

from t1async.models.chat_template import ChatTemplateRenderer

_LOADED: dict[str, ChatTemplateRenderer] = {}
"""Each folder's renderer, loaded once per test session (a renderer is copied per use)."""


def renderer(folders, name: str) -> ChatTemplateRenderer:
    """A fresh renderer (``template_mismatches`` 0) over the folder's tokenizer, loaded once per module."""
    if name not in _LOADED:
        _LOADED[name] = ChatTemplateRenderer.load(folders[name])
    base = _LOADED[name]
    return ChatTemplateRenderer(base.tokenizer, base.eos_ids, base.path)
