"""Tool calls in the model's own format: parse an assistant turn as its chat template writes calls.

A model trained on a chat template calls tools the way that template renders an assistant message with
``tool_calls``; the policy's turns must be parsed in that layout, never in another model's. Three formats
(each parses exactly what its template renders, whitespace included, and is lenient only on the blank lines
around the call's parts):

- :data:`QWEN3_JSON` (Qwen3): ``<tool_call>\\n{"name": "bash", "arguments": {"command": "ls"}}\\n</tool_call>``;
  the arguments are JSON.
- :data:`QWEN3_CODER_XML` (Qwen3-Coder, Qwen3.5): ``<tool_call>\\n<function=bash>\\n<parameter=command>\\nls\\n
  </parameter>\\n</function>\\n</tool_call>``; a value is raw text (the template writes strings as they are,
  numbers and booleans through Jinja's ``string``, objects and arrays as JSON) and is converted to the type
  the tool's JSON schema gives its parameter.
- :data:`GLM45` (GLM-4.5, GLM-4.6): ``<tool_call>bash\\n<arg_key>command</arg_key>\\n<arg_value>ls</arg_value>\\n
  </tool_call>``; a string value is raw, any other is JSON (the template's ``tojson``), read as the schema says.

:func:`detect` tells from a template's source which format it declares. A call is checked against the tools'
JSON schemas (:func:`check_call`: name, required, unexpected and ill-typed arguments). Problems carry a
reason among :data:`t1async.trajectory.TOOL_CALL_ERRORS` (``no_tool_call``, ``unbalanced``, ``bad_json``
(the call's body is not in the format's layout, JSON or XML), ``unknown_tool``, ``bad_arguments``,
``multiple_calls``: one call per turn) and a sentence for the error observation (:func:`error_message`).

Injection: the output of a command is never the model's turn, but the model's own text may spell
``<tool_call>`` as ordinary characters. With the real tokenizers the tags are single added-token ids;
:func:`parse_ids` reads the sampled *ids* and takes only those ids as tags (a tag spelled as plain tokens is
text), as t1async/rollout/actions.py does on the shipped tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

__all__ = ["BASH_TOOL", "GLM45", "QWEN3_CODER_XML", "QWEN3_JSON", "FORMATS", "ToolCall", "ToolCallFormat",
           "ToolCallProblem", "check_call", "detect", "error_message", "how_to_call", "parse_ids", "tag_ids"]

BASH_TOOL = {
    "name": "bash",
    "description": "Run one command in the task's bash shell (working directory /app; the shell keeps its state "
                   "between calls) and return its output.",
    "parameters": {"type": "object",
                   "properties": {"command": {"type": "string", "description": "The shell command to run."}},
                   "required": ["command"]},
}
"""The one tool of ``env.action_format`` tool_call (a JSON-schema function spec)."""


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of a declared tool: ``name`` and ``arguments`` (converted to the schema's types)."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolCallProblem:
    """Why a turn is not one valid call: ``reason`` (a value of ``TOOL_CALL_ERRORS``) and ``what``, a sentence
    for the agent (:func:`error_message`)."""

    reason: str
    what: str


@runtime_checkable
class ToolCallFormat(Protocol):
    """A chat template's tool-call layout.

    Attributes:
        name: the format's name (a key of :data:`FORMATS`).
        open_tag, close_tag: the strings around one call (single added-token ids in the real tokenizers).
    """

    name: str
    open_tag: str
    close_tag: str

    def parse(self, text: str, tools: Sequence[dict] = ...) -> ToolCall | ToolCallProblem:
        """The one call in an assistant turn's decoded text, tags found as text; never raises."""

    def parse_call(self, inner: str, tools: Sequence[dict] = ...) -> ToolCall | ToolCallProblem:
        """The call whose body (the text between ``open_tag`` and ``close_tag``) is ``inner``; never raises."""

    def example(self, name: str, arguments: dict) -> str:
        """The call of ``name`` with ``arguments`` as the template renders it, tags included."""


# -- checking a call against the tools' JSON schemas ------------------------------------------------------------

_PY_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
             "object": (dict,), "null": (type(None),)}
_ARTICLE = {"integer": "an", "array": "an", "object": "an"}


def _spec(tool: dict) -> dict:
    """A JSON-schema function spec, from either it or its OpenAI ``{"type": "function", "function": ...}`` form."""
    return tool["function"] if isinstance(tool.get("function"), dict) else tool


def _types(schema: dict) -> list[str]:
    t = schema.get("type") if isinstance(schema, dict) else None
    return [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []


def _has_type(value, types: list[str]) -> bool:
    if not types:
        return True
    for t in types:
        if t in ("integer", "number") and isinstance(value, bool):
            continue
        if isinstance(value, _PY_TYPES.get(t, object)):
            return True
    return False


def _a(types: list[str]) -> str:
    return " or ".join(f"{_ARTICLE.get(t, 'a')} {t}" for t in types)


def _tool_by_name(name, tools: Sequence[dict]) -> dict | ToolCallProblem:
    specs = [_spec(t) for t in tools]
    for s in specs:
        if s.get("name") == name:
            return s
    names = [s.get("name") for s in specs]
    only = f"the only tool is {names[0]!r}" if len(names) == 1 else f"the tools are {', '.join(map(repr, names))}"
    return ToolCallProblem("unknown_tool", f"there is no tool {name!r}; {only}.")


def check_call(name, arguments, tools: Sequence[dict] = (BASH_TOOL,)) -> ToolCall | ToolCallProblem:
    """``name`` and ``arguments`` as a :class:`ToolCall` of one of ``tools``, or the first problem found.

    Order (as t1async/rollout/actions.py has always reported): an unknown tool (``unknown_tool``); then, all
    ``bad_arguments``: arguments that are not an object, a required argument missing or an argument of another
    type than its schema's ``type`` (JSON-schema types; a bool is not an integer), arguments the schema does
    not declare (never run: a tool takes only what it declares).

    Args:
        name: the called tool's name, as the model wrote it.
        arguments: the parsed arguments (a dict when well-formed).
        tools: JSON-schema function specs (``{"name", "description", "parameters"}``) or their OpenAI form.
    """
    spec = _tool_by_name(name, tools)
    if isinstance(spec, ToolCallProblem):
        return spec
    if not isinstance(arguments, dict):
        return ToolCallProblem("bad_arguments", "arguments must be a JSON object.")
    params = spec.get("parameters") or {}
    props = params.get("properties") or {}
    for key in [*params.get("required", []), *(k for k in props if k not in params.get("required", []))]:
        types = _types(props.get(key, {}))
        if key not in arguments:
            if key in params.get("required", []):
                return ToolCallProblem("bad_arguments", f"the argument {key} is missing.")
            continue
        if not _has_type(arguments[key], types):
            return ToolCallProblem("bad_arguments", f"the argument {key} is a {type(arguments[key]).__name__}, "
                                                    f"not {_a(types)}.")
    extra = sorted(set(arguments) - set(props))
    if extra:
        takes = f"takes only {', '.join(props)}" if props else "takes no arguments"
        return ToolCallProblem("bad_arguments", f"unexpected arguments {extra}; {spec['name']} {takes}.")
    return ToolCall(spec["name"], dict(arguments))


def _convert(key: str, raw: str, tools: Sequence[dict], name: str, json_only: bool) -> tuple[bool, object]:
    """A raw parameter value as its schema's type: (ok, value) or (False, problem sentence).

    Strings stay as written; another type is read as JSON (``json_only``, GLM's ``tojson``) or also as Python's
    ``str`` of it (Qwen3-Coder's Jinja ``string``: ``True``/``False``/``None``). A parameter the tool does not
    declare (or an unknown tool) stays a string: :func:`check_call` reports it."""
    spec = _tool_by_name(name, tools)
    props = {} if isinstance(spec, ToolCallProblem) else (spec.get("parameters") or {}).get("properties") or {}
    types = _types(props.get(key, {}))
    if key not in props or not types or "string" in types:
        return True, raw
    text = raw.strip()
    if not json_only:
        text = {"True": "true", "False": "false", "None": "null"}.get(text, text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False, f"the argument {key} is {raw[:60]!r}, not {_a(types)}."
    if isinstance(value, float) and "integer" in types and value.is_integer() and "number" not in types:
        value = int(value)
    if not _has_type(value, types):
        return False, f"the argument {key} is {raw[:60]!r}, not {_a(types)}."
    return True, value


# -- the formats -------------------------------------------------------------------------------------------------


def _count_problem(n_open: int, n_close: int, open_first: bool, fmt: "ToolCallFormat") -> ToolCallProblem | None:
    """The problem of a turn with ``n_open`` opening and ``n_close`` closing tags (``open_first``: the first
    opening tag precedes the first closing one), or None for exactly one balanced call."""
    if not n_open and not n_close:
        return ToolCallProblem("no_tool_call", "your message holds no tool call.")
    if n_open > 1 or n_close > 1:
        return ToolCallProblem("multiple_calls", f"your message holds {max(n_open, n_close)} tool calls; none was run.")
    if n_open != n_close or not open_first:
        return ToolCallProblem("unbalanced", f"every {fmt.open_tag} needs its {fmt.close_tag} after it.")
    return None


class _Tagged:
    """What the three formats share: one call between ``<tool_call>`` and ``</tool_call>``."""

    name = ""
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str, tools: Sequence[dict] = (BASH_TOOL,)) -> ToolCall | ToolCallProblem:
        """The one call in ``text`` (an assistant turn's decoded text, reasoning and text around the call
        allowed), tags found as text: for decoded *ids*, use :func:`parse_ids` (a tag spelled as plain tokens
        is then text). NUL characters are dropped. Never raises."""
        text = text.replace("\x00", "")
        n_open, n_close = text.count(self.open_tag), text.count(self.close_tag)
        i, j = text.find(self.open_tag), text.find(self.close_tag)
        problem = _count_problem(n_open, n_close, i < j, self)
        if problem is not None:
            return problem
        return self.parse_call(text[i + len(self.open_tag): j], tools)

    def parse_call(self, inner: str, tools: Sequence[dict] = (BASH_TOOL,)) -> ToolCall | ToolCallProblem:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<tool-call format {self.name}>"


class _Qwen3Json(_Tagged):
    name = "qwen3_json"

    def parse_call(self, inner: str, tools: Sequence[dict] = (BASH_TOOL,)) -> ToolCall | ToolCallProblem:
        """``{"name": ..., "arguments": {...}}`` (blank space around it allowed)."""
        try:
            call = json.loads(inner)
        except json.JSONDecodeError as e:
            return ToolCallProblem("bad_json", f"the call is not JSON ({e}).")
        if not isinstance(call, dict):
            return ToolCallProblem("bad_json", f"the call is a JSON {type(call).__name__}, not an object with name "
                                               "and arguments.")
        problem = _tool_by_name(call.get("name"), tools)
        if isinstance(problem, ToolCallProblem):
            return problem
        extra = sorted(set(call) - {"name", "arguments"})
        if extra:
            return ToolCallProblem("bad_arguments", f"unexpected keys {extra}.")
        return check_call(call.get("name"), call.get("arguments"), tools)

    def example(self, name: str, arguments: dict) -> str:
        """Qwen3's rendering: ``'<tool_call>\\n{"name": "' + name + '", "arguments": ' + arguments|tojson +
        '}\\n</tool_call>'`` (transformers' ``tojson`` is ``json.dumps(ensure_ascii=False)``)."""
        return f'{self.open_tag}\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}' \
               f"\n{self.close_tag}"


def _jinja_string(value) -> str:
    """A value as the templates write a parameter: strings raw, objects and arrays as JSON, the rest as
    Jinja's ``string`` (Python's ``str``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>(?=\s*(?:<parameter=|\Z))", re.S)
"""One parameter: its value ends at the first ``</parameter>`` followed by the next parameter or the end of the
call, so a value may hold ``</parameter>`` itself (a command that greps for it)."""


def _key_value_arguments(pattern: re.Pattern, body: str, tools: Sequence[dict], name: str, json_only: bool,
                         layout: str) -> dict | ToolCallProblem:
    """The arguments of one call written as consecutive key/value matches of ``pattern`` (group 1 the key,
    group 2 the value), each converted to the schema's type (:func:`_convert`); ``layout`` names the pair's
    form in the problem a stray text after the pairs gives. A key given twice or a bad conversion is
    ``bad_arguments``, text after the pairs ``bad_json``."""
    arguments: dict = {}
    pos = 0
    for p in pattern.finditer(body):
        if body[pos:p.start()].strip():
            break
        key = p.group(1).strip()
        if key in arguments:
            return ToolCallProblem("bad_arguments", f"the argument {key} is given twice.")
        ok, value = _convert(key, p.group(2), tools, name, json_only=json_only)
        if not ok:
            return ToolCallProblem("bad_arguments", value)
        arguments[key] = value
        pos = p.end()
    if body[pos:].strip():
        return ToolCallProblem("bad_json", f"{body[pos:].strip()[:60]!r} in the call is not {layout}.")
    return arguments


class _Qwen3CoderXml(_Tagged):
    name = "qwen3_coder_xml"

    def parse_call(self, inner: str, tools: Sequence[dict] = (BASH_TOOL,)) -> ToolCall | ToolCallProblem:
        """``\\n<function=NAME>\\n(<parameter=KEY>\\nVALUE\\n</parameter>\\n)*</function>\\n``: one newline
        is stripped on each side of a value, as the template adds them; values are converted to the schema's
        types (a bad conversion is ``bad_arguments``)."""
        m = _FUNCTION.fullmatch(inner)
        if m is None:
            return ToolCallProblem("bad_json", "the call is not <function=NAME> ... </function> inside the tags.")
        name, body = m.group(1).strip(), m.group(2)
        arguments = _key_value_arguments(_PARAMETER, body, tools, name, json_only=False,
                                         layout="<parameter=KEY>\\nVALUE\\n</parameter>")
        return arguments if isinstance(arguments, ToolCallProblem) else check_call(name, arguments, tools)

    def example(self, name: str, arguments: dict) -> str:
        """Qwen3-Coder's (and Qwen3.5's) rendering of one call, tags included."""
        params = "".join(f"<parameter={k}>\n{_jinja_string(v)}\n</parameter>\n" for k, v in arguments.items())
        return f"{self.open_tag}\n<function={name}>\n{params}</function>\n{self.close_tag}"


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>(?=\s*(?:<arg_key>|\Z))", re.S)
"""One key/value pair: the value ends at the first ``</arg_value>`` followed by the next key or the end of the
call, so a value may hold ``</arg_value>`` itself."""


class _Glm45(_Tagged):
    name = "glm45"

    def parse_call(self, inner: str, tools: Sequence[dict] = (BASH_TOOL,)) -> ToolCall | ToolCallProblem:
        """``NAME\\n(<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n)*``: a value is kept as written for a
        string parameter, read as JSON otherwise (a bad one is ``bad_arguments``)."""
        k = inner.find("<arg_key>")
        name, body = (inner, "") if k < 0 else (inner[:k], inner[k:])
        name = name.strip()
        if not name or "<" in name or "\n" in name:
            return ToolCallProblem("bad_json", "the call does not start with the function's name "
                                               "(<tool_call>NAME then <arg_key>/<arg_value> pairs).")
        arguments = _key_value_arguments(_GLM_ARG, body, tools, name, json_only=True,
                                         layout="an <arg_key>K</arg_key><arg_value>V</arg_value> pair")
        return arguments if isinstance(arguments, ToolCallProblem) else check_call(name, arguments, tools)

    def example(self, name: str, arguments: dict) -> str:
        """GLM-4.5/4.6's rendering of one call (a non-string value through ``tojson(ensure_ascii=False)``)."""
        args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>"
                       f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>\n"
                       for k, v in arguments.items())
        return f"{self.open_tag}{name}\n{args}{self.close_tag}"


QWEN3_JSON: ToolCallFormat = _Qwen3Json()
"""Qwen3's JSON-in-tags calls."""
QWEN3_CODER_XML: ToolCallFormat = _Qwen3CoderXml()
"""Qwen3-Coder's and Qwen3.5's XML function calls."""
GLM45: ToolCallFormat = _Glm45()
"""GLM-4.5's and GLM-4.6's ``<arg_key>``/``<arg_value>`` calls."""
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (QWEN3_JSON, QWEN3_CODER_XML, GLM45)}
"""Every known format by name."""

_MARKERS = {
    "qwen3_coder_xml": (re.compile(r"<function="), re.compile(r"<parameter=")),
    "glm45": (re.compile(r"<arg_key>"), re.compile(r"<arg_value>")),
    "qwen3_json": (re.compile(r"<tool_call>"), re.compile(r"""\{\\?["']name\\?["']: """)),
}
"""What a template's source writes when it renders (or declares) calls of each format: both patterns."""


def detect(chat_template: str) -> ToolCallFormat:
    """The tool-call format a chat template declares, from what its source writes: Qwen3-Coder's
    ``<function=``/``<parameter=``, GLM's ``<arg_key>``/``<arg_value>``, Qwen3's ``<tool_call>`` followed by a
    JSON ``{"name": ...``.

    Raises:
        ValueError: the template declares none of the known formats, or several (one line naming them).
    """
    if not isinstance(chat_template, str) or not chat_template:
        raise ValueError(f"no chat template to detect a tool-call format in (got {type(chat_template).__name__}); "
                         "give the tokenizer folder's chat template")
    found = [n for n, pats in _MARKERS.items() if all(p.search(chat_template) for p in pats)]
    if len(found) == 1:
        return FORMATS[found[0]]
    if found:
        raise ValueError(f"the chat template writes tool calls in several formats ({', '.join(found)}); cannot tell "
                         "which the model uses")
    raise ValueError("the chat template declares no known tool-call format (known: "
                     f"{', '.join(FORMATS)}); use env.action_format=command or a template of a known family")


# -- ids and error observations ----------------------------------------------------------------------------------


def tag_ids(renderer, fmt: ToolCallFormat) -> tuple[int, int]:
    """The single ids of ``fmt``'s opening and closing tags in ``renderer``'s vocabulary.

    ``renderer``: a :class:`t1async.models.chat_template.ChatTemplateRenderer` (added tokens of its
    tokenizer) or the shipped :class:`t1async.models.tokenizer.ChatTokenizer` (its ``tool_call_id`` and
    ``tool_call_end_id``).

    Raises:
        ValueError: a tag is not one added token of the vocabulary (its calls could not be told from text).
    """
    if hasattr(renderer, "tool_call_id"):
        ids = {"<tool_call>": renderer.tool_call_id, "</tool_call>": renderer.tool_call_end_id}
        got = [ids.get(fmt.open_tag), ids.get(fmt.close_tag)]
    else:
        tok = renderer.tokenizer
        added = {t.content: i for i, t in tok.added_tokens_decoder.items()}
        got = [added.get(fmt.open_tag), added.get(fmt.close_tag)]
    missing = [t for t, i in zip((fmt.open_tag, fmt.close_tag), got) if i is None]
    if missing:
        raise ValueError(f"the tokenizer has no single added-token id for {missing}: its {fmt.name} tool calls "
                         "cannot be told from text; use env.action_format=command")
    return int(got[0]), int(got[1])


def parse_ids(renderer, body_ids: Sequence[int], fmt: ToolCallFormat | None = None,
              tools: Sequence[dict] = (BASH_TOOL,)) -> ToolCall | ToolCallProblem:
    """The one call in an assistant turn's sampled ids ``body_ids`` (its final stop id removed).

    Only the tag *ids* (:func:`tag_ids`) are tags: a ``<tool_call>`` the model spelled as ordinary tokens is
    text, around the call or inside it. Only the ids between the tags are decoded (NUL characters dropped)
    and parsed by ``fmt.parse_call``. Never raises for what the policy wrote.

    Args:
        renderer: a ``ChatTemplateRenderer`` or the shipped ``ChatTokenizer``.
        body_ids: the sampled ids, ints in [0, vocab).
        fmt: the format; default :func:`detect` on the renderer's chat template.
        tools: the declared tools' JSON-schema specs.

    Raises:
        ValueError: no format given and the template declares none, or the tags are not single ids.
    """
    if fmt is None:
        fmt = detect(getattr(getattr(renderer, "tokenizer", None), "chat_template", None))
    open_id, close_id = tag_ids(renderer, fmt)
    body = [int(t) for t in body_ids]
    opens = [i for i, t in enumerate(body) if t == open_id]
    closes = [i for i, t in enumerate(body) if t == close_id]
    problem = _count_problem(len(opens), len(closes), bool(opens and closes) and opens[0] < closes[0], fmt)
    if problem is not None:
        return problem
    return fmt.parse_call(renderer.decode(body[opens[0] + 1: closes[0]]).replace("\x00", ""), tools)


def how_to_call(fmt: ToolCallFormat, end_signal: str) -> str:
    """The error observation's hint: how to call the bash tool in ``fmt`` and how to end."""
    return (f"Call the bash tool as {fmt.example(BASH_TOOL['name'], {'command': 'ls'})}, one call per message; "
            f"reply with `{end_signal}` and no tool call when the task is done.")


def error_message(problem: ToolCallProblem, fmt: ToolCallFormat, end_signal: str) -> str:
    """The observation the agent sees for a malformed call: ``[tool call error (REASON): WHAT HOW]``."""
    return f"[tool call error ({problem.reason}): {problem.what} {how_to_call(fmt, end_signal)}]"
