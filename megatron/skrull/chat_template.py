"""Chat-template tokenization with a loss mask on the assistant replies.

The template itself is always rendered by transformers (``apply_chat_template``); this module
only finds which tokens of the rendered conversation are assistant replies:

* A template with ``{% generation %}`` blocks marks them itself: transformers returns the
  mask (``return_assistant_tokens_mask=True``).
* Otherwise the conversation is rendered incrementally.  For assistant turn ``i`` the reply
  is the text between ``render(messages[:i], add_generation_prompt=True)`` (the prompt that
  asks for the reply) and ``render(messages[:i + 1])`` (the conversation with it).  Both must
  be prefixes of the whole rendering -- templates that rewrite earlier turns fail with an
  error naming the fix.  Text spans map to tokens through the tokenizer's offsets; after the
  reply's last special token (its end of turn, e.g. ``<|im_end|>``, ``<|eot_id|>``, ``</s>``),
  whitespace-only formatting tokens are not trained.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import numpy as np

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot give an assistant mask for these messages."""


def has_generation_tags(template: str) -> bool:
    """Whether ``template`` marks assistant replies with ``{% generation %}`` blocks."""
    return bool(_GENERATION_TAG.search(template or ""))


def _render(hf_tok: Any, messages: list[dict[str, str]], generation_prompt: bool,
            tools: Optional[list] = None) -> str:
    try:
        return hf_tok.apply_chat_template(messages, tokenize=False, tools=tools,
                                          add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - jinja raises its own error types
        raise ChatTemplateError(f"the chat template failed on {len(messages)} message(s) "
                                f"({type(exc).__name__}: {exc}); fix the data or the "
                                "template") from exc


def assistant_char_spans(hf_tok: Any, messages: list[dict[str, str]], text: str,
                         tools: Optional[list] = None) -> list[tuple[int, int]]:
    """``[start, end)`` character spans of the assistant replies inside ``text``.

    Args:
        hf_tok: A transformers tokenizer with a chat template.
        messages: The conversation.
        text: ``apply_chat_template(messages, tokenize=False)``.
        tools: Tool definitions passed to the template (``None``: none).

    Raises:
        ChatTemplateError: The template does not render prefixes incrementally.
    """
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt = _render(hf_tok, messages[:i], True, tools)
        upto = _render(hf_tok, messages[:i + 1], False, tools)
        if not (text.startswith(prompt) and text.startswith(upto) and len(prompt) <= len(upto)):
            raise ChatTemplateError(
                "the chat template renders earlier turns differently once later turns follow "
                f"(assistant turn {i}), so its replies cannot be located; add {{% generation %}}"
                " tags around the assistant content in the template")
        spans.append((len(prompt), len(upto)))
    return spans


def _span_mask(ids: list[int], offsets: list[tuple[int, int]], text: str,
               spans: list[tuple[int, int]], special_ids: set[int]) -> np.ndarray:
    """Tokens starting inside a span, minus the whitespace after each span's last special."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    starts = np.asarray([s for s, _ in offsets], dtype=np.int64)
    for lo, hi in spans:
        inside = np.flatnonzero((starts >= lo) & (starts < hi))
        specials = [k for k in inside if ids[k] in special_ids]
        for k in inside:
            after_end = specials and k > specials[-1]
            if after_end and not text[offsets[k][0]:offsets[k][1]].strip():
                continue
            mask[k] = 1
    return mask


def _last_run(mask: np.ndarray) -> np.ndarray:
    """``mask`` keeping only its last run of ones (the last assistant reply)."""
    ones = np.flatnonzero(mask)
    if not len(ones):
        return mask
    gaps = np.flatnonzero(np.diff(ones) > 1)
    first = ones[gaps[-1] + 1] if len(gaps) else ones[0]
    out = np.zeros_like(mask)
    out[first:] = mask[first:]
    return out


def _check_tool_support(hf_tok: Any, messages: list[dict[str, Any]],
                        tools: Optional[list]) -> None:
    """A template that never mentions tool calls would silently drop them: refuse."""
    template = hf_tok.chat_template or ""
    if any(m.get("tool_calls") for m in messages) and "tool_calls" not in template:
        raise ChatTemplateError("the chat template does not render 'tool_calls' (the calls "
                                "would be lost); use a tokenizer whose template supports tools "
                                "or drop the tool calls from the data")
    if tools and "tools" not in template:
        raise ChatTemplateError("the chat template does not render 'tools' definitions; use "
                                "a tokenizer whose template supports tools or drop 'tools'")


def tokenize_chat(hf_tok: Any, messages: list[dict[str, Any]], *, tools: Optional[list] = None,
                  loss_on: str = "assistant") -> tuple[np.ndarray, np.ndarray]:
    """Tokens of ``apply_chat_template(messages, tools=tools)`` and the loss mask.

    Args:
        hf_tok: A transformers (fast) tokenizer with a chat template.
        messages: ``[{"role", "content", "tool_calls"?}, ...]``.
        tools: Tool definitions for the template (``None``: none).
        loss_on: ``"assistant"``: every assistant reply (tool calls included);
            ``"last-assistant"``: only the last reply; ``"all"``: every token.

    Returns:
        ``(tokens int64 [S], mask uint8 [S])``; ``tokens`` equals
        ``apply_chat_template(messages, tokenize=True)``; ``mask[t] == 1`` on every token of
        a trained assistant reply (content and its end-of-turn token).

    Raises:
        ChatTemplateError: See :func:`assistant_char_spans`; tool calls or tools the template
            cannot render.
    """
    _check_tool_support(hf_tok, messages, tools)
    if has_generation_tags(hf_tok.chat_template):
        out = hf_tok.apply_chat_template(messages, tools=tools, tokenize=True,
                                         return_dict=True, return_assistant_tokens_mask=True)
        ids = np.asarray(out["input_ids"], dtype=np.int64)
        mask = np.asarray(out["assistant_masks"], dtype=np.uint8)
        if loss_on == "last-assistant":  # replies are separated by untrained headers
            mask = _last_run(mask)
        return ids, (np.ones_like(mask) if loss_on == "all" else mask)
    text = _render(hf_tok, messages, False, tools)
    # apply_chat_template(tokenize=True) encodes the rendering exactly like this (the
    # template writes BOS/specials as text), so the ids are identical; the offsets map spans.
    enc = hf_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if loss_on == "all":
        return np.asarray(ids, dtype=np.int64), np.ones(len(ids), dtype=np.uint8)
    spans = assistant_char_spans(hf_tok, messages, text, tools)
    if loss_on == "last-assistant":
        spans = spans[-1:]
    special_ids = set(hf_tok.all_special_ids) | set(hf_tok.added_tokens_decoder)
    mask = _span_mask(ids, list(enc["offset_mapping"]), text, spans, special_ids)
    return np.asarray(ids, dtype=np.int64), mask
