"""How a config section validates itself: a rule beside each field, and choices as listable Enums.

A field's rule is declared where the field is, in its ``field(metadata=...)``::

    batch_size: int = field(default=4, metadata=rule(lambda v: v >= 1, "an integer >= 1"))
    reward: Reward = field(default=Reward.dense, metadata=choice(Reward, "'dense' (...) or 'binary' (...)"))

Every section is a :class:`Section`, whose :meth:`Section.check` applies the rules of its own
fields (not of its sub-sections: :func:`t1async.config.check_values` walks those), then its
rules over two of its own fields (``RULES``, :func:`section_rule`). A value of a
:class:`Choice` field outside its Enum is refused already when the config is merged
(OmegaConf's ``ValidationError``); :func:`t1async.config.load_config` words that refusal with
the field's rule text, so both say the same one line: ``KEY=VALUE is invalid: use WHAT``.

Rules that relate fields of two sections live in t1async/config/__init__.py (``_CROSS_RULES``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, ClassVar, NamedTuple

from t1async.config.errors import ConfigError

RULE = "t1async.rule"
"""The key of a field's :class:`Rule` in its ``dataclasses.field`` metadata."""


class Choice(str, enum.Enum):
    """A config choice: a ``str`` Enum whose member names are its values (OmegaConf reads a YAML or
    command-line value by member name), so ``learner.reward=binary`` works and its values can be
    listed (``list(Reward)``; tools/gen_config_docs.py lists them in docs/configuration.md).

    A member is the string it stands for: it compares, hashes, formats and prints as that string
    (``cfg.learner.reward == "dense"``, ``f"{cfg.sampler.dtype}"`` is ``float32``, ``repr`` is
    ``'dense'``), so code and messages written for plain strings keep working.
    """

    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The values, in declaration order."""
        return tuple(m.value for m in cls)


class Rule(NamedTuple):
    """What a field's value must satisfy.

    Attributes:
        ok: predicate over the (typed) value; False refuses it.
        valid: what a valid value is, in words, completing "use ..." (for example ``"an integer >= 1"``).
    """

    ok: Callable[[Any], bool]
    valid: str


def rule(ok: Callable[[Any], bool], valid: str) -> dict[str, Rule]:
    """Field metadata declaring the rule of one field (``field(default=..., metadata=rule(...))``)."""
    return {RULE: Rule(ok, valid)}


def choice(kind: type[Choice], valid: str) -> dict[str, Rule]:
    """Field metadata of a :class:`Choice` field: its value must be one of ``kind``'s values
    (a plain string equal to one passes too, for a section built in code)."""
    values = kind.values()
    return rule(lambda v: v in values, valid)


class SectionRule(NamedTuple):
    """A rule over several fields of one section, reported on one of them.

    Attributes:
        ok: predicate over the section; False refuses it.
        name: the field the refusal names (its value is shown).
        must: what that field must be, in words, completing "it must be ...".
    """

    ok: Callable[[Any], bool]
    name: str
    must: str


def section_rule(ok: Callable[[Any], bool], name: str, must: str) -> SectionRule:
    """A :class:`SectionRule`, for a section's ``RULES``."""
    return SectionRule(ok, name, must)


class FieldError(ConfigError):
    """A field's value breaks its rule; the message is ``KEY=VALUE is invalid: use WHAT`` (a field
    rule) or ``KEY=VALUE is invalid: it must be WHAT`` (a rule over several fields).

    Attributes:
        key: dotted config key (``learner.batch_size``).
        value: the refused value.
        valid: the rule's text.
    """

    def __init__(self, key: str, value: Any, valid: str, *, must: bool = False):
        super().__init__(f"{key}={value!r} is invalid: {'it must be' if must else 'use'} {valid}")
        self.key, self.value, self.valid = key, value, valid

    def at(self, source: str) -> ConfigError:
        """The same refusal, prefixed with where the config came from (``command line``, ``scale``)."""
        return ConfigError(f"{source}: {self}")


def field_rule(f: dataclasses.Field) -> Rule | None:
    """The :class:`Rule` declared on dataclass field ``f``, or None."""
    return f.metadata.get(RULE)


class Section:
    """Base of every config section: :meth:`check` applies the rules declared beside its fields,
    then the section's ``RULES`` over several of its fields."""

    RULES: ClassVar[tuple[SectionRule, ...]] = ()

    def check(self, prefix: str) -> None:
        """Refuse a field of this section whose value breaks its rule (the first, in field order),
        then a breach of one of ``RULES`` (in their order).

        Args:
            prefix: this section's dotted key in :class:`~t1async.config.Config` (``learner.megatron``),
                used to name the field.

        Raises:
            FieldError: one line naming the key, the value and what to use.
        """
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            r = field_rule(f)
            if r is None:
                continue
            value = getattr(self, f.name)
            if not r.ok(value):
                raise FieldError(f"{prefix}.{f.name}", value, r.valid)
        for sr in self.RULES:
            if not sr.ok(self):
                raise FieldError(f"{prefix}.{sr.name}", getattr(self, sr.name), sr.must, must=True)
