"""The docs run as written: every shell command and Python snippet of README.md and docs/*.md is executed here,
in order, one scratch directory per page (with `configs/` and `examples/` linked in, as in the repository's
root), at a tiny budget where it trains:

    lopd train --config ...    + TRAIN (8 rollouts, 2 tasks x 4, 16 new tokens, 2 evaluated tasks)
    lopd train RUN_DIR         + RESUME (train.max_rollouts=16: one more step)
    lopd eval ...              + EVAL (eval.max_tasks=2)
    lopd compare / lopd demo   + GRID (a budget of 8, one seed, TRAIN's sizes for every run)
    Python snippets            run with `lopd.load_config` appending TRAIN (the budget alone), examples/ on the path

Every other fenced block is accounted for: a command that cannot run here (`NOT_RUN`: GPUs, 8 processes,
vLLM's interpreter, the set-up targets; `make demo` runs as `lopd demo`, `SUBSTITUTES`), one that needs data
this machine may lack (`REQUIRES`: ACEBench's files, skipped with the reason), a listing checked against the
code it shows (`LISTINGS`), or data that must load (`own_env.md`'s ToolWorld row). A new block that is none of these fails `test_every_block_is_run_or_
accounted_for`. Slow (minutes): `make test-slow`, and CI after `make test`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

TRAIN = ["train.max_rollouts=8", "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=16",
         "eval.max_tasks=2", "eval.every_rollouts=0", "run.progress=false", "env.toolworld.n_train=40",
         "env.toolworld.n_val=8", "env.toolworld.n_test=8", "env.toolworld.n_transfer=8"]
RESUME = ["train.max_rollouts=16"]
EVAL = ["eval.max_tasks=2"]
GRID = ["budget=8", "eval_every=0", "seeds=[0]", "workers=2", f"overrides=[{', '.join(TRAIN[1:])}]"]
GRID_METHODS = "methods={grpo: {config: grpo.yaml}, lopd: {config: lopd.yaml}}"  # a grid's first two methods

# (page, how the command or block starts) -> why it is not executed here
NOT_RUN = {
    ("README.md", "make demo"): "sets up .venv first; what it then runs is `lopd demo`, run below at a tiny budget",
    ("README.md", "make test"): "the test suite itself, which this test is part of",
    ("README.md", "lopd compare --config G.yaml"): "G.yaml and old/report.json stand for your grid and a report "
                                                   "recorded elsewhere (--merge: tests/test_compare.py)",
    ("README.md", "torchrun --nproc-per-node 8 -m lopd.cli train --config lopd ..."): "8 processes, and `...` stands "
        "for your overrides (torchrun with 2 CPU ranks: tests/test_dist.py)",
    ("README.md", "torchrun --nproc-per-node 8 -m lopd.cli train --config opsd train.fsdp=true"): "8 processes "
        "(FSDP2 on 2 CPU ranks: tests/test_fsdp.py)",
    ("README.md", "lopd train --config grpo rollout.engine=vllm"): "needs vLLM's own interpreter (.venv-vllm, "
        "scripts/setup_vllm_venv.sh; tests/test_vllm_engine.py -m vllm)",
    ("docs/scaling.md", "lopd train --config configs/lopd.yaml model.name=/models/Qwen3-8B"): "a GPU and Qwen3-8B's "
        "weights",
    ("docs/scaling.md", "torchrun --nproc-per-node 8 -m lopd.cli train --config configs/lopd.yaml"): "8 GPUs and "
        "Qwen3-8B's weights",
    ("docs/scaling.md", "torchrun --nnodes 4"): "4 nodes of 8 GPUs",
    ("docs/scaling.md", "vllm serve"): "a vLLM server and Qwen3-8B's weights",
    ("docs/scaling.md", "lopd train --config configs/grpo.yaml ... rollout.engine=vllm"): "a vLLM server; `...` "
        "stands for your overrides",
    ("docs/scaling.md", "torchrun --nproc-per-node 8 -m lopd.cli train --config configs/opsd.yaml"): "8 GPUs and "
        "Qwen3-8B's weights",
}
def _acebench_data() -> str | None:
    """Why the ACEBench snippets cannot run (its data files are not on this machine), or None."""
    from lopd.envs.acebench import resolve_data_dir
    from lopd.errors import DataError

    try:
        resolve_data_dir()
    except DataError as e:
        return f"needs the ACEBench data files, as tests/test_acebench.py does ({e})"
    return None


REQUIRES = {  # (page, how the block starts) -> why it cannot run on this machine, or None (it runs)
    ("docs/acebench.md", "from lopd.envs.acebench import ACEBench,"): _acebench_data,
    ("docs/acebench.md", "from lopd.envs.acebench import ACEBenchConfig"): _acebench_data,
}
SUBSTITUTES = {  # a command not run as written, and what runs in its place
    ("README.md", "make demo"): ["lopd", "demo", "--out", "runs/demo", *GRID],
}


def _excerpt_of(path: Path):
    """Every line of the block but `...` placeholders occurs in `path`, in order: the listing is the file's."""
    def check(text: str) -> None:
        lines = [line.rstrip() for line in path.read_text().splitlines()]
        at = 0
        for line in text.splitlines():
            if not line.strip() or line.strip().startswith("..."):
                continue
            shown = re.sub(r"\s+\.\.\.\s*(#.*)?$", "", line.rstrip())  # `...  # comment` stands for elided code
            found = next((i for i in range(at, len(lines)) if lines[i].startswith(shown)), None)
            assert found is not None, f"not in {path.name} (in this order): {line!r}"
            at = found + 1
    return check


def _contract(text: str) -> None:
    """The listing's dataclasses have lopd.envs.base's fields, in order."""
    from lopd.envs import base

    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            shown = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
            assert shown == [f.name for f in dataclasses.fields(getattr(base, node.name))], node.name


def _source_tree(text: str) -> None:
    """Every module the tree names exists (in src/lopd, examples/, ...), every folder it lists (a line's first
    word) in the repository."""
    for name in re.findall(r"\b(\w+\.py)\b", text):
        assert any(list((ROOT / d).rglob(name)) for d in ("src/lopd", "examples", "scripts", "benchmarks")), name
    for line in text.splitlines():
        first = line.split()[0] if line.split() else ""
        if first.endswith("/"):
            assert (ROOT / first).is_dir() or (ROOT / "src" / "lopd" / first).is_dir() or first == "src/lopd/", first


def _toolworld_row(text: str, tmp: Path) -> None:
    """The row schema's example loads as a ToolWorld task (`env.toolworld.data_dir`)."""
    from lopd.envs.toolworld import ToolWorld, ToolWorldConfig

    (tmp / "train.jsonl").write_text(json.dumps(json.loads(text)) + "\n")
    task = ToolWorld(ToolWorldConfig(data_dir=str(tmp))).tasks("train")[0]
    assert task.id == "train-0" and task.category == "book_flight"


LISTINGS = {  # (page, how the block starts) -> a check of what it shows (None: a diagram of the code, read by eye)
    ("docs/own_env.md", "import random"): _excerpt_of(ROOT / "examples" / "unit_converter.py"),
    ("docs/own_env.md", "@dataclass(frozen=True)"): _contract,
    ("docs/architecture.md", "src/lopd/"): _source_tree,
    ("docs/architecture.md", "session = build(cfg)"): None,
    ("docs/architecture.md", "class Algorithm:"): None,
    ("docs/architecture.md", "RolloutBatch  prompt_ids"): None,
}
DATA = {("docs/own_env.md", '{"id": "train-0"'): _toolworld_row}


@dataclass
class Item:
    page: str
    line: int
    kind: str  # shell, python, or the block's language (json, "" for a plain listing)
    text: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def key(self, table: dict):
        return next((k for k in table if k[0] == self.page and self.text.startswith(k[1])), None)


def items() -> list[Item]:
    """Each shell command (continuation lines joined, comments dropped) and each other fenced block, in order."""
    out = []
    for path in DOCS:
        page = str(path.relative_to(ROOT))
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("```"):
                i += 1
                continue
            lang, start, i = lines[i][3:].strip(), i + 2, i + 1
            block = []
            while not lines[i].startswith("```"):
                block.append(lines[i])
                i += 1
            i += 1
            if lang in ("bash", "sh", "shell"):
                out += _commands(page, start, block)
            else:
                out.append(Item(page, start, lang, "\n".join(block)))
    return out


def _commands(page: str, start: int, block: list[str]) -> list[Item]:
    out, pending, first = [], "", start
    for n, raw in enumerate(block):
        line = re.sub(r"\s+#\s.*$", "", raw).rstrip()
        if not pending:
            first = start + n
        if line.strip().startswith("#") or not line.strip():
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        out.append(Item(page, first, "shell", pending + line.strip()))
        pending = ""
    return out


ITEMS = items()


def test_every_block_is_run_or_accounted_for():
    """Each command and block is executed, or named in NOT_RUN / LISTINGS / DATA with its reason; each entry
    of those tables names exactly one of them (the tables do not go stale)."""
    for item in ITEMS:
        accounted = item.kind in ("shell", "python") or item.key(LISTINGS) or item.key(DATA)
        assert accounted, f"{item.id}: a ```{item.kind} block that is neither run nor listed: {item.text[:60]!r}"
    for table in (NOT_RUN, LISTINGS, DATA, REQUIRES, SUBSTITUTES):
        for key in table:
            matching = [i.id for i in ITEMS if i.key(table) == key]
            assert len(matching) == 1, (key, matching)


_WORKDIRS: dict[str, Path] = {}  # page -> its scratch directory for the session: a page's later commands read what
# its earlier ones wrote (README.md:53 evaluates the run README.md:51 trained)


def workdir(page: str, tmp_path_factory) -> Path:
    """The page's scratch directory, like the repository's root: configs/ and examples/ linked in."""
    if page not in _WORKDIRS:
        d = tmp_path_factory.mktemp(Path(page).stem)
        for name in ("configs", "examples"):
            (d / name).symlink_to(ROOT / name)
        _WORKDIRS[page] = d
    return _WORKDIRS[page]


def _environment() -> dict:
    path = os.pathsep.join(p for p in [str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")] if p)
    return {**os.environ, "PYTHONPATH": path, "LOPD_PYTHON": sys.executable, "OMP_NUM_THREADS": "2",
            "PYTHONUNBUFFERED": "1"}


def tiny(command: str) -> list[str]:
    """What is appended to a lopd command: the tiny budget of its kind."""
    words = command.split()
    if words[:2] == ["lopd", "train"] and "--help" not in words:
        return TRAIN if "--config" in words else RESUME
    if words[:2] == ["lopd", "eval"]:
        return EVAL
    if words[:2] == ["lopd", "compare"]:
        return GRID + [GRID_METHODS]
    return []


def run_shell(item: Item, cwd: Path) -> subprocess.CompletedProcess:
    import shlex

    words = SUBSTITUTES.get(item.key(SUBSTITUTES)) or [*shlex.split(item.text), *tiny(item.text)]
    script = 'lopd() { "$LOPD_PYTHON" -m lopd.cli "$@"; }; python() { "$LOPD_PYTHON" "$@"; }; ' + shlex.join(words)
    return subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, env=_environment(),
                          timeout=900)


PRELUDE = f"""import lopd.config as _config
_load_config = _config.load_config
_config.load_config = lambda path=None, overrides=None: _load_config(path, list(overrides or []) + {TRAIN!r})
"""


def run_python(item: Item, cwd: Path) -> subprocess.CompletedProcess:
    script = cwd / f"snippet_{item.line}.py"
    script.write_text(PRELUDE + item.text + "\n")
    return subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True,
                          env=_environment(), timeout=900)


def check_item(item: Item, tmp_path_factory, tmp_path: Path) -> None:
    """Run one command or snippet as written (or check the listing or data it is), in its page's directory."""
    cwd = workdir(item.page, tmp_path_factory)
    if item.key(NOT_RUN) and not item.key(SUBSTITUTES):
        pytest.skip(f"not run here: {NOT_RUN[item.key(NOT_RUN)]}")
    if item.key(REQUIRES) and (missing := REQUIRES[item.key(REQUIRES)]()):
        pytest.skip(missing)
    if item.key(LISTINGS):
        check = LISTINGS[item.key(LISTINGS)]
        if check is None:
            pytest.skip("a diagram of the code, not a program")
        check(item.text)
        return
    if item.key(DATA):
        DATA[item.key(DATA)](item.text, tmp_path)
        return
    out = run_shell(item, cwd) if item.kind == "shell" else run_python(item, cwd)
    assert out.returncode == 0, f"{item.id}: {item.text}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}"


def item_id(item: Item) -> str:
    return f"{item.id} {item.text.splitlines()[0][:50]}"


# README.md's items, in its order, in one process: `make test-docs` distributes by file (--dist loadfile) and
# the guides of docs/ are tests/test_docs_guides.py's
@pytest.mark.slow
@pytest.mark.parametrize("item", [i for i in ITEMS if i.page == "README.md"], ids=item_id)
def test_the_readme_runs_as_written(item: Item, tmp_path_factory, tmp_path):
    check_item(item, tmp_path_factory, tmp_path)
