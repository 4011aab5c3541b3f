"""A complete lopd environment in about 40 lines: convert quantities with three tools whose units are enums.

    lopd train --config examples/unit_converter_smollm2.yaml      # SmolLM2-135M-Instruct + LoRA learns it
    lopd train --config grpo env.name=examples/unit_converter.py:UnitConverter env.eval_splits=test
    lopd train --config lopd env.name=examples/unit_converter.py:UnitConverter env.options.n=400 env.eval_splits=test

Three worked examples come before each request as chat turns (SHOTS): without them SmolLM2-135M-Instruct
answers in prose (0 of 32 train tasks); with them it makes the call on 62% of them greedily, and sampled at
0.7 most groups of 8 have reward variance, which is what GRPO learns from (docs/own_env.md). The bundled tiny
policy knows only ToolWorld's tools and scores 0 here either way.

See docs/own_env.md for the protocol (tasks, score, reference) and the call-syntax helpers used here.
"""

import random

from lopd import Score, Task
from lopd.envs.calls import Call, ParseFailure, parse_calls, render_calls

TOOLS = {"convert_length": ["mm", "cm", "m", "km"], "convert_mass": ["g", "kg", "t"], "convert_time": ["s", "min", "h"]}
SYSTEM = "You call tools. Reply with exactly one call: tool_name(arg=value, ...).\nTools:\n" + "\n".join(
    f'{name}(value: number, source: "{"|".join(units)}", target: "{"|".join(units)}")' for name, units in TOOLS.items())
SHOTS = [("How many g is 3 kg?", 'convert_mass(value=3, source="kg", target="g")'),  # (request, the call)
         ("How many min is 120 s?", 'convert_time(value=120, source="s", target="min")'),
         ("How many km is 5000 m?", 'convert_length(value=5000, source="m", target="km")')]
TURNS = tuple(turn for request, call in SHOTS for turn in ({"role": "user", "content": request},
                                                            {"role": "assistant", "content": call}))


class UnitConverter:
    name = "unit_converter"

    def __init__(self, n: int = 200, seed: int = 0):
        rng = random.Random(seed)
        self.rows = []
        for i in range(n):
            tool = rng.choice(sorted(TOOLS))
            source, target = rng.sample(TOOLS[tool], 2)
            value = rng.randint(1, 999)
            call = Call(tool, {"value": value, "source": source, "target": target})
            request = {"role": "user", "content": f"How many {target} is {value} {source}?"}
            self.rows.append(Task(f"unit-{i}", ({"role": "system", "content": SYSTEM}, *TURNS, request),
                                  call.arguments | {"name": tool}, category=tool))

    def splits(self):
        return ("train", "test")

    def tasks(self, split: str):
        if split not in self.splits():
            raise ValueError(f"unit_converter has splits train and test, not {split!r}")
        return self.rows[: len(self.rows) * 3 // 4] if split == "train" else self.rows[len(self.rows) * 3 // 4:]

    def reference(self, task: Task) -> str:  # what OPSD's teacher reads
        answer = dict(task.answer)
        return render_calls([Call(answer.pop("name"), answer)])

    def score(self, task: Task, completion: str) -> Score:
        calls = parse_calls(completion)
        if isinstance(calls, ParseFailure):
            return Score(0.0, False, f"Unparseable output: {calls.reason}.")
        answer = dict(task.answer)
        name = answer.pop("name")
        if len(calls) != 1 or calls[0].name != name:  # feedback says what is wrong, never the answer itself
            return Score(0.0, False, f"Expected one call of {name}, got {render_calls(calls)}.")
        wrong = [k for k in answer if calls[0].arguments.get(k) != answer[k]] + sorted(calls[0].arguments.keys() - answer.keys())
        if wrong:
            return Score(0.0, False, f"Parameter '{wrong[0]}' is wrong or unexpected.")
        return Score(1.0, True, "Correct call.")
