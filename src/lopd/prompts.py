"""The one way a prompt becomes tokens, for every consumer (rollout, evaluation, teacher, SFT).

A privileged context (a reference answer, feedback, retrieved experiences) is appended to the system
message, before the user's request, so that the student's and the teacher's prompts differ only by it
and share the same chat template.
"""

from __future__ import annotations

from typing import Sequence


def context_examples(examples: Sequence[tuple[str, str]]) -> str:
    """Earlier successful attempts as context: [(request, answer text)]."""
    return "\n".join(["Successful calls for similar requests:", *(f"- {r} -> {a}" for r, a in examples)])


def context_reference(answer_text: str) -> str:
    """The task's reference answer as context (OPSD)."""
    return f"Reference answer: {answer_text}"


def context_feedback(feedback: str, attempt: str) -> str:
    """The checker's verdict on an attempt as context (SDPO)."""
    return f"An earlier attempt was {attempt}\nFeedback on it: {feedback}"


def context_skills(skills: Sequence[str]) -> str:
    """Short textual skills distilled from earlier successes (Skill-SD)."""
    return "\n".join(["Skills from earlier successes:", *(f"- {s}" for s in skills)])


def task_text(task) -> str:
    """What retrieval matches a task on: its request (ToolWorld) or its last user message."""
    if task.meta.get("request"):
        return task.meta["request"]
    users = [m["content"] for m in task.messages if m["role"] == "user"]
    return users[-1] if users else task.messages[-1]["content"]


def offered_tools(task) -> list[str]:
    """The names of the tools a task offers: its `meta["tools"]` schemas (ToolWorld, ACEBench, BFCL; a plugin
    env may set it too), or none."""
    return [t["name"] for t in task.meta.get("tools") or () if isinstance(t, dict) and "name" in t]


def called_tools(completion: str) -> list[str]:
    """The names of the tools a completion calls (none if it is not a call)."""
    from lopd.envs.calls import ParseFailure, parse_calls

    calls = parse_calls(completion)
    return [] if isinstance(calls, ParseFailure) else sorted({c.name for c in calls})


def join_contexts(*parts: str | None) -> str | None:
    kept = [p for p in parts if p]
    return "\n\n".join(kept) if kept else None


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


PLACEHOLDER = "(context)"  # marks where latent slots go when no text context is given (its tokens are replaced)


def context_span(tokenizer, messages: Sequence[dict], context: str | None) -> tuple[list[int], int, int]:
    """The prompt's token ids with `context` in place (exactly `encode_prompt`'s), and the token span
    [start, end) that the context's characters occupy (tokens straddling its edges included).
    No context: the plain prompt and the empty span (0, 0)."""
    if context is None:
        return encode_prompt(tokenizer, messages), 0, 0
    text = prompt_text(tokenizer, messages, context)
    begin = prompt_text(tokenizer, messages, _MARK).index(_MARK)  # what precedes a context never depends on it
    if text[begin:begin + len(context)] != context:
        raise ValueError("the chat template does not render a system-message context verbatim; latent slots "
                         "cannot be placed in context (use algorithm.lopd.position=prefix)")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    inside = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < begin + len(context) and b > begin]
    start, end = (inside[0], inside[-1] + 1) if inside else (0, 0)
    return enc["input_ids"], start, end


_MARK = "\x00lopd-context\x00"
