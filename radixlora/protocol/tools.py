"""Tool calling (OpenAI's `tools` and `tool_choice`). A request's tools reach the chat template
as Hugging Face templates expect them; what the model writes becomes `tool_calls` in one of
three ways:
- a named function (`tool_choice: {"type": "function", "function": {"name": N}}`): the output
  is constrained to the function's parameters schema and is its arguments;
- `required`: the output is constrained to a JSON array of {"name", "parameters"} objects,
  one of the tools each (at most one with parallel_tool_calls false), as vLLM does;
- `auto`: the output is free, and the launch's tool-call parser (`--tool-call-parser`) finds
  the calls in the model family's own format (Hermes / Qwen `<tool_call>`, Llama 3 JSON,
  Mistral `[TOOL_CALLS]`, Phi-4-mini `functools[...]`, pythonic `[f(x=1)]` for Gemma 3); the
  text around them is the message's content."""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from radixlora.errors import InvalidRequestError
from radixlora.structured import Structure

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text

    def as_openai(self, index: int | None = None) -> dict:
        """OpenAI's tool_calls entry (with `index` for a streamed delta)."""
        call = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def check_tools(tools: Sequence[dict]) -> dict[str, dict]:
    """Each tool's parameters schema by function name; a 400 naming `tools` for a tool that
    is not a function with a valid name and an object schema, or a name given twice."""
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': "
                                      "{...}}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 letters, digits, "
                                      f"_ or -, got {name!r}", param="tools")
        if name in schemas:
            raise InvalidRequestError(f"tool {name!r} is given twice", param="tools")
        parameters = function.get("parameters") or ANY_OBJECT
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema "
                                      "object", param="tools")
        schemas[name] = parameters
    return schemas


def named_structure(schemas: dict[str, dict], name: str) -> Structure:
    """tool_choice naming a function: the output is its arguments."""
    if name not in schemas:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools",
                                  param="tool_choice")
    return Structure("json_schema", json.dumps(schemas[name]), param="tools", strict=False)


def required_structure(schemas: dict[str, dict], parallel: bool) -> Structure:
    """tool_choice "required": a JSON array of calls of the tools (one with parallel false)."""
    calls = [{"type": "object",
              "properties": {"name": {"const": name}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in schemas.items()]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return Structure("json_schema", json.dumps(array), param="tools", strict=False)


def calls_of_required(text: str) -> list[ToolCall]:
    """The calls of an output written under required_structure: every complete one (an
    output cut short keeps the calls it finished)."""
    items = _json(text)
    if not isinstance(items, list):
        items = _complete_items(text)
    return [_call(item["name"], item.get("parameters")) for item in items
            if isinstance(item, dict) and "name" in item]


def _complete_items(text: str) -> list:
    """The complete elements of a JSON array cut short."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[") + 1
    while 0 < at < len(text):
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        items.append(item)
        while at < len(text) and text[at] in ", \n\t":
            at += 1
    return items


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(name, arguments) -> ToolCall:
    return ToolCall(str(name), arguments if isinstance(arguments, str)
                    else json.dumps(arguments if arguments is not None else {},
                                    ensure_ascii=False))


class ToolParser:
    """Finds a model family's tool calls in its free output (tool_choice auto)."""

    start: str = ""  # what opens the calls; the content is the text before it

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls); no calls: the whole text is the content."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = self._calls(text[at:])
        if not calls:
            return text, []
        content = text[:at].strip()
        return content or None, calls

    def streamable(self, text: str) -> int:
        """How much of the output so far is surely content: up to where calls start, or
        could start (a partial opening at its end is held back)."""
        at = text.find(self.start)
        if at >= 0:
            return at
        for keep in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def _calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError


class HermesParser(ToolParser):
    """Hermes, Qwen 2.5 / 3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
    block per call (the last may lack its closing tag when the output ends there)."""

    start = "<tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, text: str) -> list[ToolCall]:
        calls = []
        for body in self.BLOCK.findall(text):
            value = _json(body)
            if not isinstance(value, dict) or "name" not in value:
                return []
            calls.append(_call(value["name"], value.get("arguments")))
        return calls


class Llama3JsonParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls: the output is `{"name": ..., "parameters": {...}}`
    (objects separated by ";"), optionally after `<|python_tag|>`."""

    start = "{"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_objects(body):
            value = _json(part)
            if not isinstance(value, dict) or "name" not in value:
                return text, []
            calls.append(_call(value["name"], value.get("parameters", value.get("arguments"))))
        return (None, calls) if calls else (text, [])

    def streamable(self, text: str) -> int:
        """Nothing while the output may still be a call (it starts with "{" or the tag)."""
        head = text.lstrip()[: len(self.TAG)]
        if not head or head.startswith("{") or self.TAG.startswith(head):
            return 0
        return len(text)


def _split_objects(text: str) -> list[str]:
    """`{...}; {...}` into its objects (a ";" inside a string does not split)."""
    parts, depth, quoted, escaped, begin = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if quoted:
            escaped, quoted = (False, quoted) if escaped else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            quoted = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(text[begin:i].strip())
            begin = i + 1
    parts.append(text[begin:].strip())
    return [p for p in parts if p]


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""

    start = "[TOOL_CALLS]"

    def _calls(self, text: str) -> list[ToolCall]:
        return _json_calls(text[len(self.start):])


def _json_calls(payload: str) -> list[ToolCall]:
    """A JSON array of {"name", "arguments"} objects (or one object); [] if it is not one."""
    value = _json(payload.strip())
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, dict) and "name" in v
                                              for v in value):
        return []
    return [_call(v["name"], v.get("arguments", v.get("parameters"))) for v in value]


class Phi4MiniParser(ToolParser):
    """Phi-4-mini: `functools[{"name": ..., "arguments": {...}}, ...]`."""

    start = "functools["

    def _calls(self, text: str) -> list[ToolCall]:
        return _json_calls(text[len("functools"):])


class PythonicParser(ToolParser):
    """Gemma 3, Llama 3.2 / 4 prompted to call in Python: the output is a list of calls,
    `[get_weather(city="Rome", days=2), get_time(zone="UTC")]`, with literal keyword
    arguments. Read with ast (parsed, never evaluated); anything else is content."""

    start = "["

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = [self._call(node) for node in tree.elts]
        return (None, calls) if all(calls) else (text, [])

    @staticmethod
    def _call(node: ast.expr) -> ToolCall | None:
        if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name)
                or node.args or any(k.arg is None for k in node.keywords)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            return _call(node.func.id, arguments)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None

    def streamable(self, text: str) -> int:
        """Nothing while the output may still be a list of calls (it starts with "[")."""
        head = text.lstrip()
        return 0 if not head or head.startswith("[") else len(text)


class ToolChoice(msgspec.Struct, frozen=True):
    """How a chat request's output becomes tool calls: mode "none" (plain content), "named"
    (the output is `name`'s arguments), "required" (a JSON array of calls) or "auto" (the
    server's `parser` finds them; with none, the output is content); `structure` constrains
    the output of "named" and "required"."""

    mode: str = "none"
    name: str = ""
    structure: Structure | None = None
    parser: str | None = None

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":  # arguments that do not parse were cut by max_tokens
            return (None, [ToolCall(self.name, text)]) if _json(text) is not None else (text, [])
        if self.mode == "required":
            calls = calls_of_required(text)
            return (None, calls) if calls else (text, [])
        if self.mode == "auto" and self.parser is not None:
            return PARSERS[self.parser]().parse(text)
        return text, []

    def streamable(self, text: str) -> int:
        """How much of the output so far may be streamed as content."""
        if self.mode == "auto":
            return len(text) if self.parser is None else PARSERS[self.parser]().streamable(text)
        return len(text) if self.mode == "none" else 0

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished output and its finish_reason ("tool_calls"
        when calls end it)."""
        content, calls = self.split(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason


# vLLM's and SGLang's names for each family
PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "qwen25": HermesParser, "qwen": HermesParser,
    "llama3_json": Llama3JsonParser, "llama3": Llama3JsonParser,
    "mistral": MistralParser,
    "phi4_mini_json": Phi4MiniParser, "phi4_mini": Phi4MiniParser,
    "pythonic": PythonicParser,
}


# what a chat template contains when its model writes calls in a parser's format, in the order
# tried: Hermes / Qwen 2.5 / Qwen3 <tool_call>, Mistral [TOOL_CALLS], Phi-4-mini's tool block,
# the pythonic templates (Llama 3.2 / 4, Gemma 3), Llama 3.1's JSON calls
SIGNATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("phi4_mini_json", ("functools[", "<|/tool|>")),
    ("pythonic", ("[func_name1(",)),
    ("llama3_json", ("<|python_tag|>", '"parameters": dictionary of argument name')),
)


def detect_parser(templates: Sequence[str]) -> str | None:
    """The tool-call parser a model's chat templates (the one it renders with first, then its
    other named ones) show it writes; None when none of SIGNATURES appears."""
    for name, marks in SIGNATURES:
        if any(mark in template for template in templates for mark in marks):
            return name
    return None
