"""The one way a prompt becomes tokens, for every consumer (rollout, evaluation, teacher, SFT).

A privileged context (a reference answer, feedback, retrieved experiences) is appended to the system
message, before the user's request, so that the student's and the teacher's prompts differ only by it
and share the same chat template.
"""

from __future__ import annotations

from typing import Sequence


def with_context(messages: Sequence[dict], context: str | None) -> list[dict]:
    messages = [dict(m) for m in messages]
    if not context:
        return messages
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = messages[0]["content"] + "\n\n" + context
    else:
        messages.insert(0, {"role": "system", "content": context})
    return messages


def prompt_text(tokenizer, messages: Sequence[dict], context: str | None = None) -> str:
    return tokenizer.apply_chat_template(with_context(messages, context), tokenize=False, add_generation_prompt=True)


def encode_prompt(tokenizer, messages: Sequence[dict], context: str | None = None) -> list[int]:
    return tokenizer(prompt_text(tokenizer, messages, context), add_special_tokens=False)["input_ids"]
