"""The environment protocol: a source of tasks with a verifiable reward.

An env hands out `Task`s (chat messages up to the assistant turn, plus a ground truth) and scores a
completion with a `Score` (reward, success, one feedback sentence). Everything downstream (rollout,
algorithms, evaluation) only sees these two types, so a new benchmark is one file in `envs/`.

Also here, the helpers the benchmark envs share: reading JSON-lines data (`read_jsonl`), the seeded
train/test split (`hash_split`), config checks, and two pieces of call checking (`dotted_name`,
`bipartite_matching`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Literal, Protocol, Sequence, overload, runtime_checkable

from lopd.choices import Choice
from lopd.errors import ConfigError, DataError


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
    """What lopd calls on an env. Required: `tasks` and `score` (a multi-turn env: `tasks`, `step`,
    `score_episode`). Optional: `name` (default: the class's name), `splits` (named in error messages),
    `reference` (needed by OPSD alone, which refuses to start without it; evaluation shows it when there),
    `score_many`, `score_modes` (docs/own_env.md). Rewards must be finite numbers: a method that raises or
    a non-finite reward stops the run with one line naming the method and the task."""

    name: str

    def splits(self) -> Sequence[str]: ...

    def tasks(self, split: str) -> Sequence[Task]: ...

    def score(self, task: Task, completion: str) -> Score: ...

    def reference(self, task: Task) -> str:
        """Optional: the task's reference answer written as the policy should write it (OPSD's context)."""
        ...


def require_keys(row: dict, keys: Sequence[str], where: str) -> None:
    """DataError naming `where` (file:line) and the first of `keys` that `row` lacks."""
    for key in keys:
        if key not in row:
            raise DataError(f"{where}: missing key '{key}' (row has: {', '.join(row) or 'nothing'})")


@overload
def read_jsonl(path: Any, required: Sequence[str] = (), *, with_lines: Literal[False] = False,
               missing_hint: str = "") -> list[dict]: ...


@overload
def read_jsonl(path: Any, required: Sequence[str] = (), *, with_lines: Literal[True],
               missing_hint: str = "") -> list[tuple[int, dict]]: ...


def read_jsonl(path, required=(), *, with_lines=False, missing_hint=""):
    """Read a JSON-lines file; a bad line raises DataError naming file, line and key.

    `path`: a str or path-like, or an `importlib.resources` Traversable (data shipped in a package).
    Blank lines are skipped; every other line must be a JSON object holding the `required` keys.
    `with_lines`: return (line number, row) pairs instead of rows, for messages about a row's content.
    `missing_hint`: appended in parentheses to the "no such data file" message (e.g. how to install the data).
    """
    if isinstance(path, (str, os.PathLike)):
        path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file" + (f" ({missing_hint})" if missing_hint else ""))
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
            require_keys(row, required, f"{path}:{lineno}")
            rows.append((lineno, row) if with_lines else row)
    return rows


def hash_split(ids: Iterable[str], seed: int, fraction: float, *, salt: str,
               strata: Callable[[str], Hashable] | None = None, groups: Callable[[str], str] | None = None,
               round_half_up: bool = False) -> set[str]:
    """The ids that go to `train` in a seeded train/test split (the other ids are `test`).

    The split is made of units: an id, or with `groups` the key `groups(id)` that ids which must stay
    together share (the turns of one conversation). Units are ranked by sha256 of "<salt>/<seed>/<unit>",
    so the split is deterministic, independent of the ids' order and of Python's hash seed, and differs
    between envs (`salt`) and seeds; the first round(fraction * n) of the n units go to `train`
    (Python's round: halves to even; with `round_half_up`, floor(fraction * n + 0.5), as ACEBench's split
    was defined). With `strata` (e.g. an id's category) each stratum is split on its own, so
    each keeps its share; a group is taken within its stratum. Repeated ids count once.
    """
    strata_units: dict[Hashable, dict[str, list[str]]] = {}
    for task_id in dict.fromkeys(ids):
        units = strata_units.setdefault(strata(task_id) if strata else None, {})
        units.setdefault(groups(task_id) if groups else task_id, []).append(task_id)
    train: set[str] = set()
    for units in strata_units.values():
        ranked = sorted(units, key=lambda unit: hashlib.sha256(f"{salt}/{seed}/{unit}".encode()).hexdigest())
        share = len(ranked) * fraction
        for unit in ranked[: math.floor(share + 0.5) if round_half_up else round(share)]:
            train.update(units[unit])
    return train


class ScoringMode(Choice):
    official = "official"  # the benchmark's released evaluator's verdict, quirks included
    strict = "strict"  # exact values after documented normalisation (the training reward)


def check_mode_and_fraction(env: str, mode: str, modes: Sequence[str], train_fraction: float) -> str:
    """The mode, if it is one of `modes` and 0 <= `train_fraction` <= 1; ConfigError naming the key
    `env.<env>.*` otherwise."""
    if mode not in modes:
        raise ConfigError(f"env.{env}.mode: '{mode}' is not one of {', '.join(modes)}")
    if not 0.0 <= train_fraction <= 1.0:
        raise ConfigError(f"env.{env}.train_fraction: {train_fraction} is not between 0 and 1")
    return mode


def dotted_name(node: ast.expr) -> str:
    """The dotted name a call's `func` node spells: "a.b.f"; below anything but a name, only the
    attributes count (`x().f` gives "f", a subscript or call alone gives "")."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def bipartite_matching(ok: list[list[bool]]) -> list[int | None]:
    """A maximum matching by augmenting paths: ok[i][j] says row i (an expected call) accepts column j
    (a reply call). Returns, per row, its column or None; no row is None iff a perfect matching exists."""
    owner: dict[int, int] = {}  # column j -> row i

    def augment(i: int, seen: set[int]) -> bool:
        for j, fits in enumerate(ok[i]):
            if fits and j not in seen:
                seen.add(j)
                if j not in owner or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    for i in range(len(ok)):
        augment(i, set())
    by_row: list[int | None] = [None] * len(ok)
    for j, i in owner.items():
        by_row[i] = j
    return by_row
