"""The environment protocol: a source of tasks with a verifiable reward.

An env hands out `Task`s (chat messages up to the assistant turn, plus a ground truth) and scores a
completion with a `Score` (reward, success, one feedback sentence). Everything downstream (rollout,
algorithms, evaluation) only sees these two types, so a new benchmark is one file in `envs/`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

from lopd.errors import DataError


@dataclass(frozen=True)
class Task:
    id: str
    messages: tuple[dict, ...]  # chat messages before the assistant turn (system, user, ...)
    answer: Any  # the ground truth, JSON-serialisable; its shape is the env's business
    category: str = "default"
    meta: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Score:
    reward: float
    success: bool
    feedback: str  # one sentence: what was right or what exactly was wrong


@runtime_checkable
class Env(Protocol):
    name: str

    def splits(self) -> Sequence[str]: ...

    def tasks(self, split: str) -> Sequence[Task]: ...

    def score(self, task: Task, completion: str) -> Score: ...

    def reference(self, task: Task) -> str:
        """The task's reference answer written as the policy should write it (OPSD's context)."""
        ...


def read_jsonl(path: str | Path, required: Sequence[str] = ()) -> list[dict]:
    """Read a JSON-lines file; a bad line raises DataError naming file, line and key."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for key in required:
                if key not in row:
                    raise DataError(f"{path}:{lineno}: missing key '{key}' (row has: {', '.join(row) or 'nothing'})")
            rows.append(row)
    return rows
