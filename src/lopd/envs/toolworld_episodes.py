"""ToolWorld episodes: a multi-turn variant in which the request hides a value behind a saved detail.

    user:      Book a flight from my home city to Rome on March 5, 2025 in economy class.
    assistant: lookup(key="home city")
    tool:      London
    assistant: book_flight(origin="LON", destination="ROM", date="2025-03-05", cabin="C")

Every task of the base ToolWorld whose answer has a city or a person gets one of them replaced in the
request by an alias ("my home city", "my manager"); a `lookup(key)` tool is added to its tools. The env
answers a lookup with the saved value (or says the key is unknown) and ends the episode on any other
output; the episode's last assistant turn is scored by ToolWorld's checker. Tool results come back as
`tool` messages: observations the policy reads but is never trained on.
"""

from __future__ import annotations

import random
from dataclasses import replace

from lopd.envs.base import Score, Task
from lopd.envs.calls import Call, ParseFailure, parse_calls, render_calls
from lopd.envs.toolworld import ToolWorld, task_messages
from lopd.envs.toolworld_kinds import CITIES

LOOKUP = {"name": "lookup", "description": "Look up one of the user's saved details.",
          "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}
ALIASES = {"city": ["home city", "usual destination", "office city"], "person": ["manager", "sister", "landlord"]}
_CODES = {code: name for name, code in CITIES}


def _hideable(task: Task) -> tuple[str, str, str] | None:
    """(argument name, kind, natural value) of a city or person the request states verbatim."""
    tool = next(t for t in task.meta["tools"] if t["name"] == task.answer[0]["name"])
    for name, value in task.answer[0]["arguments"].items():
        if not isinstance(value, str):
            continue
        if value in _CODES or value in _CODES.values():  # a city, as code or name
            natural = _CODES.get(value, value)
            if natural in task.meta["request"]:
                return name, "city", natural
        desc = tool["parameters"]["properties"].get(name, {}).get("description", "")
        person = value if ", " not in value else " ".join(reversed(value.split(", ")))
        if (" " in person and person.replace(" ", "").isalpha() and person in task.meta["request"]
                and "city" not in desc):
            return name, "person", person
    return None


class ToolWorldEpisodes(ToolWorld):
    name = "toolworld_episodes"

    def __init__(self, config=None):
        super().__init__(config)
        self._episode_splits: dict[str, list[Task]] = {}

    def tasks(self, split: str):
        if split not in self._episode_splits:
            self._episode_splits[split] = self._hide_values(split)
        return self._episode_splits[split]

    def _hide_values(self, split: str) -> list[Task]:
        rng = random.Random(f"toolworld-episodes/{self.config.seed}/{split}")
        out = []
        for task in super().tasks(split):
            hidden = _hideable(task)
            if hidden is None:
                continue
            _, kind, natural = hidden
            key = rng.choice(ALIASES[kind])
            request = task.meta["request"].replace(natural, f"my {key}", 1)
            tools = [LOOKUP, *task.meta["tools"]]
            meta = {**task.meta, "request": request, "tools": tools, "saved": {key: natural}}
            out.append(replace(task, messages=task_messages(tools, request), meta=meta))
        return out

    def step(self, task: Task, history: list[dict]) -> list[dict] | None:
        """The env's answer to the last assistant turn, or None when the episode is over."""
        calls = parse_calls(history[-1]["content"])
        if isinstance(calls, ParseFailure) or len(calls) != 1 or calls[0].name != "lookup":
            return None
        key = str(calls[0].arguments.get("key", "")).strip().lower().removeprefix("my ").strip()
        saved = task.meta["saved"]
        content = saved.get(key, f"No saved detail named '{key}'. Saved: {', '.join(saved)}.")
        return [{"role": "tool", "content": content}]

    def score_episode(self, task: Task, history: list[dict]) -> Score:
        last = next((m["content"] for m in reversed(history) if m["role"] == "assistant"), "")
        return self.score(task, last)

    def reference(self, task: Task) -> str:
        key = next(iter(task.meta["saved"]))
        lookup = render_calls([Call("lookup", {"key": key})])
        return f"{lookup}, then {super().reference(task)}"
