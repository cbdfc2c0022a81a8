"""Chat record formats -> one conversation (OpenAI ``messages`` plus optional ``tools``).

``tools/preprocess_sft.py`` reads four record formats (docs/data.md, "Input formats"); the
format of a file is detected from its first record (:func:`detect_format`) or named with
``--input-format``, and every record of the file must then fit it:

* ``messages``: OpenAI chat, ``{"messages": [{"role", "content"}, ...], "tools"?: [...]}``
  with roles ``system``/``user``/``assistant``/``tool``; assistant messages may carry
  ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments"}}]``).
* ``sharegpt``: ``{"conversations": [{"from", "value"}, ...], "system"?, "tools"?}``; ``from``
  is ``human``/``user``, ``gpt``/``assistant``, ``system``, ``function_call`` (the value is the
  call's JSON ``{"name", "arguments"}``: an assistant tool call) or ``observation``/``tool``
  (a tool result), the roles LLaMA-Factory's ShareGPT files use.
* ``alpaca``: ``{"instruction", "input"?, "output", "system"?, "history"?}``: the user turn is
  the instruction, a blank line and the input when the input is non-empty; ``history`` holds
  earlier ``[instruction, output]`` pairs.
* ``prompt-response``: ``{"prompt", "response", "system"?}``.

Fields that are ``null`` count as absent (Parquet and Arrow rows fill missing struct fields
with nulls).  Errors are :class:`InputError` naming ``FILE:LINE`` and the fix.
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple, Optional

INPUT_FORMATS = ("messages", "sharegpt", "alpaca", "prompt-response")
CHAT_ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool",
                  "tool": "tool", "function_response": "tool"}
LOSS_ON = ("assistant", "last-assistant", "all")


class InputError(ValueError):
    """Bad preprocessing input (malformed record, overlong or empty sample)."""


class Conversation(NamedTuple):
    """One chat: OpenAI-style ``messages`` and the tool definitions (``None``: no tools)."""

    messages: list[dict[str, Any]]
    tools: Optional[list] = None


def drop_nulls(value: Any) -> Any:
    """``value`` with every ``None``-valued dict key removed, recursively."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def detect_format(record: Any, where: str) -> str:
    """The format of ``record`` (one of :data:`INPUT_FORMATS`) from its keys."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    keys = {k for k, v in record.items() if v is not None}
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if "instruction" in keys and "output" in keys:
        return "alpaca"
    if "prompt" in keys or "response" in keys:
        return "prompt-response"
    raise InputError(f"{where}: record fits no input format (keys {sorted(keys)}); expected "
                     "'messages' (OpenAI), 'conversations' (ShareGPT), 'instruction'+'output' "
                     "(Alpaca) or 'prompt'+'response'; fix the record or pass --input-format")


def _tools(record: dict, where: str) -> Optional[list]:
    tools = record.get("tools")
    if isinstance(tools, str):  # ShareGPT files store the definitions as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError:
            raise InputError(f"{where}: 'tools' is a string but not JSON") from None
    if tools is not None and not isinstance(tools, list):
        raise InputError(f"{where}: 'tools' must be a list of tool definitions")
    return tools or None


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise InputError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    out = []
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise InputError(f"{where}: message {j} needs 'role' and 'content' keys")
        msg = dict(msg)
        if msg["role"] not in CHAT_ROLES:
            raise InputError(f"{where}: message {j} has role {msg['role']!r}; expected one of "
                             f"{', '.join(CHAT_ROLES)}")
        calls = msg.get("tool_calls")
        if calls is not None:
            if msg["role"] != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function", c), dict)
                    and isinstance(c.get("function", c).get("name"), str) for c in calls):
                raise InputError(f"{where}: message {j}: 'tool_calls' must be a list of "
                                 "{type, function: {name, arguments}} on an assistant message")
            msg.setdefault("content", "")
        if "content" not in msg:
            raise InputError(f"{where}: message {j} needs 'role' and 'content' keys")
        if not isinstance(msg["content"], str):
            raise InputError(f"{where}: message {j} content must be a string")
        out.append(msg)
    return out


def _sharegpt(record: dict, where: str) -> list[dict[str, Any]]:
    turns = record.get("conversations")
    if not isinstance(turns, list):
        raise InputError(f"{where}: 'conversations' must be a list of {{from, value}} objects")
    messages = []
    if isinstance(record.get("system"), str) and record["system"]:
        messages.append({"role": "system", "content": record["system"]})
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise InputError(f"{where}: conversation turn {j} needs 'from' and 'value' keys")
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise InputError(f"{where}: turn {j} has from={turn['from']!r}; expected one of "
                             f"{', '.join(SHAREGPT_ROLES)}")
        if not isinstance(turn["value"], str):
            raise InputError(f"{where}: turn {j} value must be a string")
        if turn["from"] != "function_call":
            messages.append({"role": role, "content": turn["value"]})
            continue
        try:
            call = json.loads(turn["value"])
        except json.JSONDecodeError:
            call = None
        calls = call if isinstance(call, list) else [call]
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            raise InputError(f"{where}: turn {j} (function_call) value must be the call's JSON "
                             '{"name": ..., "arguments": {...}}')
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": c["name"],
                                              "arguments": c.get("arguments", {})}}
            for c in calls]})
    return messages


def _alpaca(record: dict, where: str) -> list[dict[str, Any]]:
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str):
            raise InputError(f"{where}: Alpaca record needs string {key!r} (and optional "
                             "'input', 'system', 'history')")
    messages = []
    if isinstance(record.get("system"), str) and record["system"]:
        messages.append({"role": "system", "content": record["system"]})
    for j, pair in enumerate(record.get("history") or []):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                and all(isinstance(t, str) for t in pair)):
            raise InputError(f"{where}: history entry {j} must be [instruction, output]")
        messages += [{"role": "user", "content": pair[0]},
                     {"role": "assistant", "content": pair[1]}]
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise InputError(f"{where}: Alpaca 'input' must be a string")
    user = record["instruction"] + ("\n\n" + extra if extra else "")
    return messages + [{"role": "user", "content": user},
                       {"role": "assistant", "content": record["output"]}]


def _prompt_response(record: dict, where: str) -> list[dict[str, Any]]:
    for key in ("prompt", "response"):
        if key not in record:
            raise InputError(f"{where}: missing key {key!r} (prompt/response format needs both)")
    messages = [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["response"]}]
    if "system" in record:
        messages.insert(0, {"role": "system", "content": record["system"]})
    return messages


_KEYS = {"messages": "'messages'", "sharegpt": "'conversations'",
         "alpaca": "'instruction' and 'output'", "prompt-response": "'prompt' and 'response'"}


def to_conversation(record: Any, fmt: str, where: str) -> Conversation:
    """Validates ``record`` as format ``fmt`` and returns its conversation.

    Args:
        record: One parsed record (a dict).
        fmt: One of :data:`INPUT_FORMATS`.
        where: ``FILE:LINE`` for error messages.

    Raises:
        InputError: The record does not fit ``fmt`` or holds a bad message.
    """
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    record = drop_nulls(record)
    if fmt == "messages" and "messages" in record:
        messages = record["messages"]
    elif fmt == "sharegpt" and "conversations" in record:
        messages = _sharegpt(record, where)
    elif fmt == "alpaca" and ("instruction" in record or "output" in record):
        messages = _alpaca(record, where)
    elif fmt == "prompt-response" and ("prompt" in record or "response" in record):
        messages = _prompt_response(record, where)
    else:
        raise InputError(f"{where}: record does not fit the {fmt} format of this file (needs "
                         f"{_KEYS[fmt]}, got keys {sorted(record)}); give every record of a "
                         "file one format or fix --input-format")
    return Conversation(_check_messages(messages, where), _tools(record, where))


def _tool_call_text(call: dict) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):  # OpenAI stores the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)


def plain_turns(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(role, text)`` turns for a tokenizer without a chat template (role markers only).

    Tool calls and tool results are written as Hermes-style text, the convention of
    Qwen2.5's chat template: each call appended to its assistant turn as
    ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, each tool result a user
    turn ``<tool_response>\\n...\\n</tool_response>``.
    """
    turns = []
    for msg in messages:
        if msg["role"] == "tool":
            turns.append(("user", f"<tool_response>\n{msg['content']}\n</tool_response>"))
            continue
        text = msg["content"]
        for call in msg.get("tool_calls") or ():
            text += ("\n" if text else "") + f"<tool_call>\n{_tool_call_text(call)}\n</tool_call>"
        turns.append((msg["role"], text))
    return turns


def trained_turns(roles: list[str], loss_on: str) -> list[bool]:
    """Which turns the loss covers under ``--sft-loss-on`` (:data:`LOSS_ON`)."""
    if loss_on == "all":
        return [True] * len(roles)
    trained = [r == "assistant" for r in roles]
    if loss_on == "last-assistant" and any(trained):
        last = max(i for i, t in enumerate(trained) if t)
        trained = [i == last for i in range(len(roles))]
    return trained
