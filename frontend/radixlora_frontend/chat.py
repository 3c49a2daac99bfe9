"""Chat roles rendered incrementally with the model's chat template.

A program's text only grows (so its prefix stays in the radix cache), yet chat templates render
whole conversations. A role's text is therefore found by difference: render the messages so far,
render them plus the new message with a sentinel as its content, and split what was added around
the sentinel into (prefix, suffix). With the fallback template (`<|role|>\\ncontent\\n`, see
radixlora.text.chat) this gives exactly `render(messages)`; a template whose rendering of a
conversation is not a prefix of its rendering with one more message (rare) falls back to the
message rendered alone."""

from __future__ import annotations

from radixlora.text.chat import ChatTemplate

SENTINEL = "\x00radixlora-content\x00"


def role_affixes(template: ChatTemplate, history: list[dict], role: str) -> tuple[str, str]:
    """(text before the content, text after it) of a `role` message following `history`."""
    message = {"role": role, "content": SENTINEL}
    before = template.render(history, add_generation_prompt=False) if history else ""
    after = template.render([*history, message], add_generation_prompt=False)
    if not after.startswith(before):
        before, after = "", template.render([message], add_generation_prompt=False)
    prefix, found, suffix = after[len(before) :].partition(SENTINEL)
    if not found:
        raise ValueError(f"the chat template drops the content of {role!r} messages")
    return prefix, suffix
