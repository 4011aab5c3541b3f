"""teacher.py: the teacher re-scores completions exactly as a plain forward over [context ; prompt ;
completion] would; frozen weights never move, EMA weights move at their rate, live weights get no gradient;
the context's token span inside the chat template."""

import copy

import torch

from lopd.config import load_config
from lopd.models import load_policy
from lopd.prompts import context_span, encode_prompt, with_context
from lopd.rollout import RolloutBatch, sample
from lopd.teacher import EMATeacher, FrozenTeacher, LiveTeacher


def test_teacher_logprobs_equal_a_separate_forward_over_context_prompt_completion(tiny, toolworld):
    model, tok = tiny
    tasks = list(toolworld.tasks("test")[:3])
    prompts = [encode_prompt(tok, t.messages) for t in tasks]
    s = sample(model, tok, prompts, temperature=0.0, max_new_tokens=24)
    batch = RolloutBatch(**vars(s), tasks=tasks, group=torch.arange(3), rewards=torch.zeros(3),
                         success=torch.zeros(3, dtype=torch.bool), feedback=[""] * 3)
    contexts = [f"Reference answer: {toolworld.reference(t)}" for t in tasks]
    with torch.no_grad():
        got = FrozenTeacher(model, tok).score(batch, contexts).logprobs()
        for i, (task, ctx) in enumerate(zip(tasks, contexts)):
            text = tok.apply_chat_template(with_context(task.messages, ctx), tokenize=False, add_generation_prompt=True)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            n = int(s.completion_mask[i].sum())
            full = torch.tensor([prompt + s.completion_ids[i, :n].tolist()])
            logits = model(input_ids=full).logits[0]  # [L, V] a plain forward, no padding at all
            ref = torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + n], -1)
            ref = ref.gather(-1, s.completion_ids[i, :n, None]).squeeze(-1)
            torch.testing.assert_close(got[i, :n], ref, atol=1e-4, rtol=0)


def _student_step(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01)


def test_frozen_teacher_never_changes_and_ema_moves_at_its_rate():
    cfg = load_config(None, [])
    model, _ = load_policy(cfg.model)
    frozen = FrozenTeacher(model)
    ema = EMATeacher(model, rate=0.25)
    before = copy.deepcopy(frozen.model.state_dict())
    ema_before = {k: v.clone() for k, v in ema.model.state_dict().items()}
    _student_step(model)
    ema.after_step()
    for k, v in frozen.model.state_dict().items():
        assert torch.equal(v, before[k])
    student = model.state_dict()
    for k, v in ema.model.state_dict().items():
        torch.testing.assert_close(v, 0.75 * ema_before[k] + 0.25 * student[k])


def test_lora_ema_teacher_is_a_second_adapter_moving_at_its_rate():
    cfg = load_config(None, ["model.lora.enabled=true", "model.lora.r=2"])
    model, _ = load_policy(cfg.model)
    ema = EMATeacher(model, rate=0.5)
    pairs = ema._pairs()
    assert pairs and all(not e.requires_grad for e, _ in pairs) and all(s.requires_grad for _, s in pairs)
    old = [e.detach().clone() for e, _ in pairs]
    _student_step(model)
    ema.after_step()
    for (e, s), o in zip(ema._pairs(), old):
        torch.testing.assert_close(e, 0.5 * o + 0.5 * s.detach())
    with ema.active():
        assert all(not e.requires_grad for e, _ in ema._pairs())
    assert model.active_adapter == "default"


def test_live_teacher_passes_no_gradient_to_the_weights(tiny):
    model, _ = tiny
    live = LiveTeacher(model)
    x = torch.randint(0, 100, (1, 5))
    with live.active() as m:
        out = m(input_ids=x).logits.sum()
    assert all(p.requires_grad for p in model.parameters())  # restored after the forward
    assert not out.requires_grad


def test_context_span_is_the_context_inside_the_rendered_prompt(tiny, toolworld):
    _, tok = tiny
    task = toolworld.tasks("train")[0]
    context = "Successful calls for similar requests:\n- a -> f(x=1)\n- b -> g(y=\"2\")"
    ids, start, end = context_span(tok, task.messages, context)
    assert ids == encode_prompt(tok, task.messages, context)
    assert context in tok.decode(ids[start:end]) and len(tok.decode(ids[start:end])) <= len(context) + 4
    plain, s, e = context_span(tok, task.messages, None)
    assert plain == encode_prompt(tok, task.messages) and (s, e) == (0, 0)
    assert tok.decode(ids[:start]).endswith("\n\n")  # the context follows the system message's own text
