"""Structured output and tool calls for the serving layer: request fields -> grammar, tools -> prompt,
answer text -> ``tool_calls``.

Calls are written in the Hermes format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one per
line), which is what a chat template without tool support is taught by ``HERMES_TOOLS_PROMPT`` and what the
grammar (``celeris.structured.grammar.tool_call_grammar``) derives. ``tool_choice``:

- ``required``: the answer is one or more calls (``parallel_tool_calls: false``: exactly one), under the grammar;
- a named function: exactly one call of it, under the grammar;
- ``auto`` (the default when tools are given): the answer is one or more calls or, instead, free text in which
  the call tag never occurs (``response_format`` JSON: that JSON instead), under the grammar
  (``FREE_TEXT``), so calls always validate and text is never a broken call; models without grammar support
  (block-diffusion models, a tokenizer llguidance cannot read) decode it unconstrained and a valid sequence of
  calls is still recognised;
- ``none``: plain text, never parsed as calls (the tools are still shown in the prompt, as OpenAI does).
"""

from __future__ import annotations

import json
import re

from celeris.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ResponseFormat,
    ToolCall,
)
from celeris.structured.grammar import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    GrammarError,
    check_grammar,
    check_parameters,
    json_object_grammar,
    schema_grammar,
    tool_call_grammar,
)

HERMES_TOOLS_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function "
    "call return a json object with function name and arguments within <tool_call></tool_call> XML tags as "
    'follows:\n<tool_call>{{"name": <function-name>, "arguments": <args-json-object>}}</tool_call>'
)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _grammar_error(exc: GrammarError) -> APIError:
    return APIError(400, str(exc), param=exc.param, code="invalid_value")


def response_format_grammar(fmt: ResponseFormat | None) -> str | None:
    """The grammar of ``response_format`` (None for text).

    Raises:
        APIError: 400 for a missing, invalid or unenforceable schema (param ``response_format...``).
    """
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            return json_object_grammar()
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format of type 'json_schema' needs json_schema.schema",
                           param="response_format.json_schema", code="missing_required_parameter")
        return schema_grammar(fmt.json_schema.json_schema)
    except GrammarError as exc:
        raise _grammar_error(exc) from None


def check_answer_grammar(grammar: str | None, tokenizer, param: str) -> None:
    """Refuse a grammar that admits no answer, or only the empty one, for this model's tokenizer
    (``celeris.structured.grammar.check_grammar``); nothing to check without a grammar or a ``tokenizer``.

    Raises:
        APIError: 400 naming ``param``.
    """
    if grammar is None or tokenizer is None:
        return
    try:
        check_grammar(grammar, tokenizer, param)
    except GrammarError as exc:
        raise _grammar_error(exc) from None


def declared_functions(request: ChatCompletionRequest) -> dict[str, dict]:
    """name -> parameters schema of ``request.tools`` (an absent schema: any object).

    Raises:
        APIError: 400 for a name declared twice.
    """
    functions: dict[str, dict] = {}
    for i, tool in enumerate(request.tools or []):
        name = tool.function.name
        if name in functions:
            raise APIError(400, f"the function '{name}' is declared twice in tools", param=f"tools[{i}].function.name")
        functions[name] = tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS
    return functions


def tool_mode(request: ChatCompletionRequest) -> str:
    """``none``, ``auto``, ``required`` or ``named`` (OpenAI's default: ``auto`` with tools, else ``none``)."""
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    return "named" if not isinstance(choice, str) else choice


def chat_grammar(request: ChatCompletionRequest) -> tuple[str | None, bool]:
    """The grammar a chat request is decoded under, or None, and whether it is optional (``tool_choice: "auto"``
    without ``response_format``: a model that cannot decode under a grammar may decode it without one).

    Raises:
        APIError: 400 for ``tool_choice`` without tools or naming an absent function, ``response_format``
            together with a forced call, parameters that are not an object schema (as OpenAI), or a schema that
            cannot be enforced.
    """
    functions = declared_functions(request)
    mode = tool_mode(request)
    if mode in ("required", "named") and not functions:
        raise APIError(400, f"tool_choice '{mode}' needs tools; none were given", param="tool_choice")
    for i, tool in enumerate(request.tools or []):
        if tool.function.parameters is not None:
            param = f"tools[{i}].function.parameters"
            try:
                check_parameters(tool.function.parameters, param)
                schema_grammar(tool.function.parameters, param)
            except GrammarError as exc:
                raise APIError(400, str(exc), param=exc.param, code="invalid_function_parameters") from None
    if mode in ("required", "named"):
        if request.response_format is not None and request.response_format.type != "text":
            raise APIError(400, "response_format cannot be combined with a forced tool call (tool_choice "
                                f"'{mode}')", param="response_format")
        if mode == "named":
            name = request.tool_choice.function.name
            if name not in functions:
                raise APIError(400, f"tool_choice names the function '{name}', which is not in tools (declared: "
                                    f"{', '.join(functions)})", param="tool_choice")
            functions = {name: functions[name]}
        try:
            parallel = mode == "required" and request.parallel_tool_calls is not False
            return tool_call_grammar(functions, parallel=parallel), False
        except GrammarError as exc:
            raise _grammar_error(exc) from None
    answer = response_format_grammar(request.response_format)
    if mode != "auto" or not functions:
        return answer, False
    fmt = request.response_format
    alternative = "text" if answer is None else {"type": "object"} if fmt.type == "json_object" else \
        fmt.json_schema.json_schema
    try:
        return tool_call_grammar(functions, request.parallel_tool_calls is not False, alternative), answer is None
    except GrammarError as exc:
        raise _grammar_error(exc) from None


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (compact JSON, as the grammar derives it); ``arguments``: JSON text."""
    call = {"name": name, "arguments": json.loads(arguments)}
    return TOOL_CALL_OPEN + json.dumps(call, separators=(",", ":")) + TOOL_CALL_CLOSE


def template_messages(request: ChatCompletionRequest, template: str | None) -> tuple[list[dict], list[dict] | None]:
    """The conversation as the chat template is given it, and the tools to pass the template.

    A template that reads ``tools`` gets the OpenAI tool list and the messages with their ``name``, their
    ``tool_calls`` (arguments as objects, as Hugging Face templates expect) and ``role: "tool"`` results. Any other template
    (Hermes fallback) gets plain text: the tool list in a system message (``HERMES_TOOLS_PROMPT``), each call as
    ``<tool_call>...</tool_call>`` in the assistant's content, and each result as a user message
    ``<tool_response>...</tool_response>`` (consecutive results merged), so templates that know only
    system/user/assistant render them.

    Raises:
        APIError: 400 for a ``tool`` message without ``tool_call_id``.
    """
    for i, m in enumerate(request.messages):
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(400, "a message with role 'tool' needs tool_call_id", param=f"messages[{i}].tool_call_id")
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
    native = bool(template) and "tools" in template
    if native:
        out = []
        for m in request.messages:
            d: dict = {"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                                   for c in m.tool_calls]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out, tools or None
    out = []
    for m in request.messages:
        if m.role == "tool":
            piece = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + piece
            else:
                out.append({"role": "user", "content": piece, "_tool_results": True})
            continue
        out.append({"role": m.role, "content": _assistant_text(m) if m.role == "assistant" else m.text()}
                   | ({"name": m.name} if m.name else {}))
    for d in out:
        d.pop("_tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(t["function"]) for t in tools)
        system = HERMES_TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def _assistant_text(m: ChatMessage) -> str:
    calls = [call_text(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return "\n".join([m.text()] * bool(m.text()) + calls)


def parse_tool_calls(text: str, functions: dict[str, dict]) -> list[ToolCall] | None:
    """The calls in ``text`` when it is nothing but Hermes calls (one per line) of declared ``functions`` whose
    arguments validate against their schemas; else None (the text is an ordinary answer)."""
    import jsonschema

    calls = []
    rest = text.strip()
    while rest:
        if not rest.startswith(TOOL_CALL_OPEN) or TOOL_CALL_CLOSE not in rest:
            return None
        body, rest = rest[len(TOOL_CALL_OPEN):].split(TOOL_CALL_CLOSE, 1)
        rest = rest.lstrip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or call.get("name") not in functions or not isinstance(call.get("arguments"),
                                                                                                dict):
            return None
        try:
            jsonschema.validate(call["arguments"], functions[call["name"]])
        except jsonschema.ValidationError:
            return None
        prefix = f'{{"name":{json.dumps(call["name"])},"arguments":'
        if body.startswith(prefix) and body.endswith("}"):  # as the grammar writes it: the model's own text
            arguments = body[len(prefix):-1]
        else:
            arguments = json.dumps(call["arguments"], ensure_ascii=False)
        calls.append(ToolCall(function=FunctionCall(name=call["name"], arguments=arguments)))
    return calls or None


CALL_HEADER = re.compile(r'<tool_call>\{"name":("(?:[^"\\]|\\.)*"),"arguments":')


class CallStreamer:
    """OpenAI tool-call deltas from the growing text of an answer that is nothing but calls (``tool_choice``
    ``required`` or named: the grammar writes each as ``<tool_call>{"name":"f","arguments":{...}}</tool_call>``).

    A call's first delta has its ``index``, ``id``, ``type`` and ``function.name`` (arguments ``""``), as
    soon as its name is complete; then every piece of its arguments is sent as it arrives, with ``index``
    only. The arguments sent add up to the text ``parse_tool_calls`` returns for the same answer.
    """

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # where to look for the next call
        self.calls: list[ToolCall] = []
        self.args_start: int | None = None  # the open call's arguments start here in ``text``
        self.sent = 0  # ``text`` up to here is sent (within the open call's arguments)

    def push(self, piece: str) -> list[DeltaToolCall]:
        """The deltas that the text ``piece`` (appended to what came before) completes."""
        self.text += piece
        out: list[DeltaToolCall] = []
        decoder = json.JSONDecoder()
        while True:
            if self.args_start is None:
                m = CALL_HEADER.search(self.text, self.pos)
                if m is None:
                    return out
                call = ToolCall(function=FunctionCall(name=json.loads(m.group(1)), arguments=""))
                self.calls.append(call)
                out.append(DeltaToolCall(index=len(self.calls) - 1, id=call.id, type="function",
                                         function=DeltaFunctionCall(name=call.function.name, arguments="")))
                self.args_start = self.sent = m.end()
            try:
                _, end = decoder.raw_decode(self.text, self.args_start)
            except json.JSONDecodeError:
                end = None
            stop = len(self.text) if end is None else end
            if stop > self.sent:
                piece = self.text[self.sent:stop]
                self.calls[-1].function.arguments += piece
                out.append(DeltaToolCall(index=len(self.calls) - 1, function=DeltaFunctionCall(arguments=piece)))
                self.sent = stop
            if end is None:
                return out
            self.pos, self.args_start = end, None
