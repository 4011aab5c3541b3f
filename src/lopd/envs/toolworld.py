"""ToolWorld: the bundled synthetic tool-use task, generated deterministically from a seed.

Rows have the shape of ACEBench/BFCL rows: JSON-schema tools (typed parameters, enums, nested
objects, optional parameters), a natural-language request, the ground-truth call. What makes
experience worth having: every tool has *conventions* (date format, units, city codes, enum codes,
name order, id style) and leaves some of them undocumented, so the request alone is ambiguous and one
successful earlier call of the same tool reveals the answer.

Splits: `train`, `val` and `test` use the same tools with disjoint requests (choose settings on `val`,
report on `test`); `transfer` uses unseen tools (other names, other conventions). `val` was added after
the other three and is drawn from its own random stream, so `train`, `test` and `transfer` are unchanged. `sft_examples` draws from a fourth pool, with conventions random per
example, to teach the bundled tiny policy the call format without teaching it any tool's conventions.

    env = ToolWorld(ToolWorldConfig(seed=0))
    task = env.tasks("test")[0]
    env.score(task, 'book_flight(origin="PAR", ...)')  # -> Score(reward, success, feedback)
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from lopd.choices import Choice
from lopd.envs.base import DataError, Score, Task, read_jsonl
from lopd.envs.calls import Call, ParseFailure, parse_calls, render_calls
from lopd.errors import ConfigError
from lopd.prompts import context_examples, context_feedback, context_reference, context_skills, join_contexts
from lopd.envs.toolworld_kinds import CATEGORIES, CODE_SETS, DOMAINS, KINDS, Domain, ParamSpec

SYSTEM_PROMPT = "You call tools. Reply with exactly one call: tool_name(arg=value, ...).\nTools:"
POOLS = {"train": 0, "transfer": 1, "sft": 2}  # pool -> index of the domain's tool-name variant
SPLITS = ("train", "val", "test", "transfer")
REWARD_MODES = ("binary", "partial")


class RewardMode(Choice):
    binary = "binary"  # 1 if the call is right, else 0
    partial = "partial"  # the fraction of right arguments


@dataclass
class ToolWorldConfig:
    seed: int = 0  # generates tools, conventions and requests
    n_train: int = 2000  # requests in `train`
    n_val: int = 200  # new requests to the train tools, disjoint from train and test, in `val` (for choices)
    n_test: int = 200  # new requests to the train tools, in `test`
    n_transfer: int = 200  # requests to unseen tools, in `transfer`
    hidden_per_tool: int = 2  # at most this many parameters per tool leave their convention undocumented
    distractors: int = 1  # other tools shown next to the right one
    reward: RewardMode = RewardMode.binary  # binary: 1 if the call is right; partial: fraction of right arguments
    data_dir: str | None = None  # read {train,val,test,transfer}.jsonl from here instead of generating (those used)
    shots: int = 0  # worked examples as chat turns before each request (`sft`-pool tools: the format, no task's conventions)


# ----------------------------------------------------------------------------------- tools


@dataclass(frozen=True)
class ToolParam:
    name: str
    spec: ParamSpec
    convention: str  # a convention name of the kind; "codes"/"words" for categories; "" otherwise
    documented: bool
    codes: tuple[tuple[str, str], ...] = ()  # category label -> code, for categories
    fields: tuple["ToolParam", ...] = ()

    @property
    def ambiguous(self) -> bool:
        return self.convention == "codes" or (self.spec.kind in KINDS and KINDS[self.spec.kind].ambiguous)

    def schema(self) -> dict:
        kind = self.spec.kind
        if kind == "object":
            return {"type": "object", "properties": {f.name: f.schema() for f in self.fields},
                    "required": [f.name for f in self.fields if f.spec.required]}
        if kind == "flag":
            return {"type": "boolean"}
        if kind.startswith("category:"):
            out = {"type": "string", "enum": sorted(code for _, code in self.codes)}
            if self.documented and self.convention == "codes":
                out["description"] = ", ".join(f"{code}={label}" for label, code in self.codes)
            return out
        base = KINDS[kind.removeprefix("list:")]
        out: dict[str, Any] = {"type": base.json_type}
        hint = next(c.hint for c in base.conventions if c.name == self.convention)
        if self.documented and hint:
            out["description"] = hint
        return {"type": "array", "items": out} if kind.startswith("list:") else out


@dataclass(frozen=True)
class Tool:
    name: str
    domain: Domain
    params: tuple[ToolParam, ...]

    def schema(self) -> dict:
        return {"name": self.name, "description": self.domain.description,
                "parameters": {"type": "object", "properties": {p.name: p.schema() for p in self.params},
                               "required": [p.name for p in self.params if p.spec.required]}}

    def conventions(self) -> dict[str, str]:
        return {p.name: p.convention for p in _leaves(self.params) if p.ambiguous}


def _make_param(spec: ParamSpec, rng: random.Random, name_variant: int) -> ToolParam:
    name = spec.names[name_variant % len(spec.names)]
    if spec.kind == "object":
        fields = tuple(_make_param(f, rng, name_variant) for f in spec.fields)
        return ToolParam(name, spec, "", True, fields=fields)
    if spec.kind == "flag":
        return ToolParam(name, spec, "", True)
    if spec.kind.startswith("category:"):
        labels = CATEGORIES[spec.kind.split(":", 1)[1]]
        if rng.random() < 0.5:
            return ToolParam(name, spec, "words", True, codes=tuple((x, x) for x in labels))
        codes = rng.sample(rng.choice(CODE_SETS), len(labels))
        return ToolParam(name, spec, "codes", False, codes=tuple(zip(labels, codes)))
    kind = KINDS[spec.kind.removeprefix("list:")]
    return ToolParam(name, spec, rng.choice(kind.conventions).name, not kind.ambiguous)


def _leaves(params: Sequence[ToolParam]) -> Iterator[ToolParam]:
    for p in params:
        yield p
        yield from _leaves(p.fields)


FIXED_NAMES = {d.tool_names[v] for d in DOMAINS for v in (POOLS["train"], POOLS["transfer"])}
NAME_WORDS = ["new", "quick", "user", "api", "v2", "service", "smart", "my", "auto", "easy", "main", "tool"]


def _sft_tool_name(domain: Domain, rng: random.Random) -> str:
    """A fresh tool name for the supervised pool: recombined words, never a train/transfer tool's name,
    so the policy learns to copy names from the schema instead of memorising them per domain."""
    while True:
        words = rng.choice(domain.tool_names).split("_")
        if rng.random() < 0.7:
            words.insert(rng.randrange(len(words) + 1), rng.choice(NAME_WORDS))
        if rng.random() < 0.3:
            rng.shuffle(words)
        name = "_".join(words)
        if name not in FIXED_NAMES:
            return name


def make_tool(domain: Domain, pool: str, rng: random.Random, hidden_per_tool: int) -> Tool:
    """One tool of `domain` with conventions drawn from `rng`; at most `hidden_per_tool` undocumented.

    `train` and `transfer` tools use fixed name variants; `sft` tools get fresh names and mix the
    parameter-name variants at random."""
    sft = pool == "sft"
    variant = POOLS[pool]
    params = tuple(_make_param(s, rng, rng.randrange(4) if sft else variant) for s in domain.params)
    ambiguous = [p for p in _leaves(params) if p.ambiguous]
    hidden = {id(p) for p in rng.sample(ambiguous, min(hidden_per_tool, len(ambiguous)))}

    def settle(p: ToolParam) -> ToolParam:
        documented = not p.ambiguous or id(p) not in hidden
        return ToolParam(p.name, p.spec, p.convention, documented, p.codes, tuple(settle(f) for f in p.fields))

    name = _sft_tool_name(domain, rng) if sft else domain.tool_names[variant]
    return Tool(name, domain, tuple(settle(p) for p in params))


def make_pool(pool: str, seed: int, hidden_per_tool: int) -> list[Tool]:
    rng = random.Random(f"toolworld/{seed}/{pool}")
    return [make_tool(d, pool, rng, hidden_per_tool) for d in DOMAINS]


# -------------------------------------------------------------------------------- requests


def _value(p: ToolParam, rng: random.Random) -> tuple[str, Any]:
    """Sample one argument: (the phrase a user says, the argument value the tool wants)."""
    kind = p.spec.kind
    if kind == "object":
        parts = [_value(f, rng) for f in p.fields]
        return " ".join(phrase for phrase, _ in parts), {f.name: v for f, (_, v) in zip(p.fields, parts)}
    if kind == "flag":
        on, off = p.spec.phrase.split("|")
        value = rng.random() < 0.5
        return (on if value else off), value
    if kind.startswith("category:"):
        label, code = rng.choice(p.codes)
        return p.spec.phrase.format(label), code
    base = KINDS[kind.removeprefix("list:")]
    write = next(c.write for c in base.conventions if c.name == p.convention)
    if kind.startswith("list:"):
        values = []
        while len(values) < rng.randint(2, 3):
            v = base.sample(rng)
            if v not in values:
                values.append(v)
        said = ", ".join(base.say(v) for v in values[:-1]) + " and " + base.say(values[-1])
        return p.spec.phrase.format(said), [write(v) for v in values]
    value = base.sample(rng)
    return p.spec.phrase.format(base.say(value)), write(value)


def make_request(tool: Tool, rng: random.Random) -> tuple[str, Call]:
    phrases, arguments = [], {}
    for p in tool.params:
        if p.spec.required or rng.random() < 0.5:
            phrase, arguments[p.name] = _value(p, rng)
            phrases.append(phrase)
    rng.shuffle(phrases)
    lead = rng.choice(["", "Please ", "Can you ", "I want to ", "Could you "])
    text = lead + rng.choice(tool.domain.intents) + " " + " ".join(phrases)
    text = text[0].upper() + text[1:] + ("?" if lead in ("Can you ", "Could you ") else ".")
    return text, Call(tool.name, arguments)


def render_tool(schema: dict) -> str:
    """A tool on one line, in the compact signature style small models read best."""

    def typ(s: dict) -> str:
        if "enum" in s:
            t = "|".join(json.dumps(v) for v in s["enum"])
        elif s["type"] == "object":
            req = set(s.get("required", []))
            t = "{" + ", ".join(f"{k}{'' if k in req else '?'}: {typ(v)}" for k, v in s["properties"].items()) + "}"
        elif s["type"] == "array":
            t = f"[{typ(s['items'])}]"
        else:
            t = s["type"]
        return f"{t} ({s['description']})" if s.get("description") else t

    params = schema["parameters"]
    req = set(params.get("required", []))
    args = ", ".join(f"{k}{'' if k in req else '?'}: {typ(v)}" for k, v in params["properties"].items())
    return f"{schema['name']}({args}) - {schema.get('description', '')}".rstrip(" -")


def task_messages(tools: Sequence[dict], request: str) -> tuple[dict, ...]:
    system = SYSTEM_PROMPT + "\n" + "\n".join(render_tool(t) for t in tools)
    return ({"role": "system", "content": system}, {"role": "user", "content": request})


def shot_turns(n: int, seed: int = 0, hidden_per_tool: int = 2) -> tuple[dict, ...]:
    """n worked examples as (user request, assistant call) turns, for a pretrained chat model that does not
    know the call format: each a request to a fresh `sft`-pool tool (never a tool of any split) and its call,
    whose schema is not shown and whose conventions are its own, so the shots teach the call format and
    nothing about any task tool's conventions. The same turns for every task of an env (seeded)."""
    rng = random.Random(f"toolworld/{seed}/shots")
    turns: list[dict] = []
    for _ in range(n):
        tool, _, _ = _sft_tools(rng, hidden_per_tool, 0)
        request, call = make_request(tool, rng)
        turns += [{"role": "user", "content": request}, {"role": "assistant", "content": call.render()}]
    return tuple(turns)


def _task(task_id: str, category: str, tools: list[dict], request: str, answer: list[Call], extra=None,
          shots: tuple[dict, ...] = ()) -> Task:
    answer_json = [{"name": c.name, "arguments": c.arguments} for c in answer]
    meta = {"tools": tools, "request": request, **(extra or {})}
    system, user = task_messages(tools, request)
    return Task(task_id, (system, *shots, user), answer_json, category, meta)


# ------------------------------------------------------------------------------------ env


class ToolWorld:
    name = "toolworld"

    def __init__(self, config: ToolWorldConfig | None = None):
        self.config = config or ToolWorldConfig()
        reward = self.config.reward
        if reward not in REWARD_MODES:
            raise ConfigError(f"env.toolworld.reward: '{reward}' is not one of {', '.join(REWARD_MODES)}")
        self.reward_mode = reward
        self._splits: dict[str, list[Task]] = {}
        self._shots = shot_turns(self.config.shots, self.config.seed, self.config.hidden_per_tool)

    def splits(self) -> Sequence[str]:
        return SPLITS

    def tools(self, pool: str) -> list[Tool]:
        return make_pool(pool, self.config.seed, self.config.hidden_per_tool)

    def tasks(self, split: str) -> Sequence[Task]:
        if split not in SPLITS:
            raise ConfigError(f"toolworld has no split '{split}' (splits: {', '.join(SPLITS)})")
        if split not in self._splits:
            self._splits[split] = self._load(split) if self.config.data_dir else self._generate(split)
        return self._splits[split]

    def _generate(self, split: str) -> list[Task]:
        c = self.config
        pool = "transfer" if split == "transfer" else "train"
        tools = self.tools(pool)
        seen: set[str] = set()
        if split in ("val", "test"):  # held-out requests never occur in train; val's never in test either
            seen = {t.meta["request"] for t in self.tasks("train")}
        if split == "val":
            seen |= {t.meta["request"] for t in self.tasks("test")}
        rng = random.Random(f"toolworld/{c.seed}/{split}/requests")
        n = {"train": c.n_train, "val": c.n_val, "test": c.n_test, "transfer": c.n_transfer}[split]
        out: list[Task] = []
        while len(out) < n:
            tool = tools[len(out) % len(tools)]
            request, call = make_request(tool, rng)
            if request in seen:
                continue
            seen.add(request)
            others = rng.sample([t for t in tools if t is not tool], min(c.distractors, len(tools) - 1))
            shown = [tool, *others]
            rng.shuffle(shown)
            out.append(_task(f"{split}-{len(out)}", tool.name, [t.schema() for t in shown], request, [call],
                             {"conventions": tool.conventions()}, self._shots))
        return out

    def _load(self, split: str) -> list[Task]:
        path = Path(self.config.data_dir) / f"{split}.jsonl"
        out = []
        for lineno, row in enumerate(read_jsonl(path, required=("id", "question", "function", "ground_truth")), 1):
            try:
                tools = row["function"]
                names = [t["name"] for t in tools]
                for t in tools:
                    t["parameters"]["properties"]  # noqa: B018 (validates the schema's shape)
                answer = [Call(g["name"], g["arguments"]) for g in row["ground_truth"]]
                request = row["question"] if isinstance(row["question"], str) else row["question"][-1]["content"]
            except (KeyError, TypeError, IndexError) as e:
                raise DataError(f"{path}: row {lineno} (id {row.get('id')!r}): malformed, bad or missing key {e}") from None
            for call in answer:
                if call.name not in names:
                    raise DataError(f"{path}: row {lineno} (id {row['id']!r}): ground_truth calls '{call.name}', "
                                    f"which is not among its functions ({', '.join(names)})")
            out.append(_task(str(row["id"]), row.get("category", answer[0].name), tools, request, answer,
                             shots=self._shots))
        return out

    def export(self, folder: str | Path) -> None:
        """Write every split as JSON lines in the shape `data_dir` reads back."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for split in SPLITS:
            with open(folder / f"{split}.jsonl", "w") as f:
                for t in self.tasks(split):
                    row = {"id": t.id, "category": t.category, "question": [{"role": "user", "content": t.meta["request"]}],
                           "function": t.meta["tools"], "ground_truth": t.answer}
                    f.write(json.dumps(row) + "\n")

    def reference(self, task: Task) -> str:
        return render_calls([Call(a["name"], a["arguments"]) for a in task.answer])

    def score(self, task: Task, completion: str) -> Score:
        calls = parse_calls(completion)
        if isinstance(calls, ParseFailure):
            return Score(0.0, False, f"Unparseable output: {calls.reason}.")
        return check_calls(calls, task.answer, task.meta["tools"], self.reward_mode)


# -------------------------------------------------------------------------------- checker

_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def _show(value: Any, limit: int = 100) -> str:
    """A value's repr for feedback, clipped to `limit` characters (ToolWorld's own values are shorter), so
    that a 15,000-character argument gives a one-line sentence; an int too long to print is described."""
    try:
        text = repr(value)
    except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion"
        return "a number too long to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_error(value: Any, schema: dict, where: str) -> str | None:
    """Why `value` does not fit `schema`, or None. bool is not an integer; int is accepted for number."""
    expected = schema.get("type", "string")
    ok = isinstance(value, _TYPES.get(expected, object)) and not (isinstance(value, bool) and expected != "boolean")
    if not ok:
        return f"parameter '{where}' should be {expected}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"parameter '{where}' must be one of {', '.join(map(str, schema['enum']))}; got {_show(value)}"
    if expected == "array":
        for i, item in enumerate(value):
            if err := type_error(item, schema.get("items", {}), f"{where}[{i}]"):
                return err
    if expected == "object" and "properties" in schema:
        return _object_error(value, schema, where + ".")
    return None


def _object_error(args: dict, schema: dict, prefix: str = "") -> str | None:
    props = schema.get("properties", {})
    for name in schema.get("required", []):
        if name not in args:
            return f"missing required parameter '{prefix}{name}'"
    for name, value in args.items():
        if name not in props:
            return f"unexpected parameter '{prefix}{name}' (not in the tool's schema)"
        if err := type_error(value, props[name], prefix + name):
            return err
    return None


def values_equal(got: Any, want: Any) -> bool:
    """Strict equality after normalisation: strings stripped, numbers by value, lists order-free."""
    if isinstance(want, bool) or isinstance(got, bool):
        return got is want
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return _numbers_close(got, want)
    if isinstance(want, str) and isinstance(got, str):
        return got.strip() == want.strip()
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(values_equal(got[k], want[k]) for k in want)
    if isinstance(want, list) and isinstance(got, list):
        rest = list(got)
        for w in want:
            match = next((i for i, g in enumerate(rest) if values_equal(g, w)), None)
            if match is None:
                return False
            rest.pop(match)
        return not rest
    return False


def _numbers_close(got: int | float, want: int | float) -> bool:
    """Equal within 1e-9 relative. An int beyond float range minus a float raises OverflowError: such
    an int is then compared exactly (it equals no float)."""
    try:
        return abs(got - want) <= 1e-9 * max(1.0, abs(want))
    except OverflowError:
        return got == want


def check_calls(calls: list[Call], answer: list[dict], tools: list[dict], reward_mode: str = "binary") -> Score:
    """Match parsed calls against the ground truth like an AST checker; feedback names the first fault."""
    by_name = {t["name"]: t for t in tools}
    if len(calls) != len(answer):
        return Score(0.0, False, f"Expected {len(answer)} call(s), got {len(calls)}.")
    total, right, fault = 0, 0, None
    for call, want in zip(calls, answer):  # ToolWorld rows hold one call; several are matched in order
        wanted_args = want["arguments"]
        total += len(wanted_args)
        if call.name not in by_name:
            fault = fault or f"Called unknown tool '{call.name}'."
            continue
        if call.name != want["name"]:
            fault = fault or f"Called '{call.name}', which does not do what the request asks."
            continue
        if err := _object_error(call.arguments, by_name[call.name]["parameters"]):
            fault = fault or err[0].upper() + err[1:] + "."
        for name, value in wanted_args.items():
            if name not in call.arguments:
                fault = fault or f"Missing parameter '{name}' that the request specifies."
            elif values_equal(call.arguments[name], value):
                right += 1
            else:
                fault = fault or f"Parameter '{name}' has the wrong value {_show(call.arguments[name])}."
        for name in call.arguments.keys() - wanted_args.keys():
            fault = fault or f"Parameter '{name}' was not asked for."
    if fault is None:
        return Score(1.0, True, "Correct call.")
    reward = right / total if reward_mode == "partial" and total else 0.0
    return Score(reward, False, fault)


# ---------------------------------------------------------------------------- SFT corpus


def _wrong_attempt(tool: Tool, call: Call, rng: random.Random) -> Call:
    """Another request's call to the same tool: a plausible attempt with wrong values."""
    for _ in range(10):
        _, other = make_request(tool, rng)
        if other != call:
            return other
    return Call(call.name, {})


def _sft_tools(rng: random.Random, hidden_per_tool: int, distractors: int) -> tuple[Tool, list[Tool], list[Tool]]:
    """A fresh `sft`-pool tool, `distractors` others of other domains, and all of them in shown order."""
    domain = rng.choice(list(DOMAINS))
    tool = make_tool(domain, "sft", rng, hidden_per_tool)
    others = [make_tool(d, "sft", rng, hidden_per_tool) for d in rng.sample([d for d in DOMAINS if d is not domain], distractors)]
    shown = [tool, *others]
    rng.shuffle(shown)
    return tool, others, shown


def sft_examples(n: int, seed: int = 0, hidden_per_tool: int = 2, distractors: int = 1,
                 p_context: float = 0.5) -> Iterator[tuple[tuple[dict, ...], str, str | None]]:
    """(messages, target call, context) for supervised training of the tiny policy.

    Tools come from the `sft` pool and are re-drawn for every example, so conventions are random per
    example: the policy learns the format and to copy documented conventions, not any tool's hidden
    ones. With probability `p_context` the example carries a privileged context that agrees with the
    target, in one of the formats the algorithms use (`lopd.prompts`): the reference answer (OPSD),
    earlier successful calls (retrieved experiences as text), skills (Skill-SD), or the feedback on a
    wrong attempt plus a successful one (SDPO). The policy learns to read each; the teacher needs that.
    """
    rng = random.Random(f"toolworld/{seed}/sft")
    for _ in range(n):
        tool, others, shown = _sft_tools(rng, hidden_per_tool, distractors)
        request, call = make_request(tool, rng)
        context = None
        if rng.random() < p_context:
            kind = rng.random()
            demos = [make_request(tool, rng) for _ in range(rng.randint(1, 3))]
            if rng.random() < 0.5:  # a demonstration of another tool, to be ignored
                demos.insert(rng.randrange(len(demos) + 1), make_request(rng.choice(others), rng))
            if kind < 0.2:
                context = context_reference(call.render())
            elif kind < 0.6:
                context = context_examples([(r, c.render()) for r, c in demos])
            elif kind < 0.8:
                context = context_skills([c.render() for _, c in demos])
            else:
                attempt = _wrong_attempt(tool, call, rng)
                verdict = check_calls([attempt], [{"name": call.name, "arguments": call.arguments}],
                                      [t.schema() for t in shown])
                context = join_contexts(context_feedback(verdict.feedback, attempt.render()),
                                        context_examples([(r, c.render()) for r, c in demos[:1]]))
        yield task_messages([t.schema() for t in shown], request), call.render(), context


def compressor_examples(n: int, seed: int = 0, k: int = 2, hidden_per_tool: int = 2, distractors: int = 1,
                        p_distractor: float = 0.25) -> Iterator[tuple[tuple[dict, ...], str]]:
    """(messages, context) for pre-training LOPD's compressor (`lopd.latent.pretrain`), no answer needed.

    A request to one tool of the `sft` pool (fresh names and conventions per example, as `sft_examples`:
    never a tool of `train`, `val`, `test` or `transfer`) shown beside `distractors` others, and as context k
    earlier successful calls in the format LOPD's retrieval writes (`context_examples`): each a call of the
    requested tool, or with probability `p_distractor` of a distractor shown beside it (retrieval by the
    task's tools finds both). A stream of its own (`toolworld/{seed}/compressor`): not the tiny policy's
    SFT examples."""
    rng = random.Random(f"toolworld/{seed}/compressor")
    for _ in range(n):
        tool, others, shown = _sft_tools(rng, hidden_per_tool, distractors)
        request, _ = make_request(tool, rng)
        demos = [make_request(rng.choice(others) if others and rng.random() < p_distractor else tool, rng) for _ in range(k)]
        yield task_messages([t.schema() for t in shown], request), context_examples([(r, c.render()) for r, c in demos])
