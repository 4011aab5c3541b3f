"""Multi-turn episodes: observations fed back, masked from every loss, re-scored exactly by a teacher."""

import torch

from lopd.envs.base import Score
from lopd.envs.calls import Call, render_calls
from lopd.envs.toolworld import ToolWorld
from lopd.envs.toolworld_episodes import ToolWorldEpisodes
from lopd.prompts import prompt_text
from lopd.rollout import RolloutBatch, sample_episodes
from lopd.tokens import score_completions


class TwoObservations(ToolWorld):
    """A real env whose step answers every turn with a tool message, twice, then ends the episode."""

    def step(self, task, history):
        turns = sum(m["role"] == "assistant" for m in history)
        return [{"role": "tool", "content": f"result number {turns}"}] if turns <= 2 else None

    def score_episode(self, task, history):
        return Score(0.0, False, "scored")


def test_observations_are_context_not_trained_and_the_sequence_is_the_template_rendering(tiny):
    model, tok = tiny
    env = TwoObservations()
    tasks = list(env.tasks("test")[:4])
    torch.manual_seed(0)
    s, episodes = sample_episodes(model, tok, env, tasks, max_turns=3, temperature=0.0, max_new_tokens=64)
    full = [i for i, h in enumerate(episodes) if len(h) == 2 + 5]
    assert full, "no episode ran its three turns"
    for i, history in enumerate(episodes):
        roles = [m["role"] for m in history[2:]]
        # an episode ends after 3 turns, or early on a turn cut off by max_new_tokens
        assert roles == ["assistant", "tool", "assistant", "tool", "assistant"][:len(roles)] and roles[-1] == "assistant"
        assert len(roles) == 5 or bool(s.truncated[i])
    for i in full:
        history = episodes[i]
        attn = s.completion_attention[i].bool()
        trained = s.completion_mask[i].bool()
        assert (trained <= attn).all() and (attn & ~trained).any()  # observations: attended, not trained
        prompt = s.prompt_ids[i][s.prompt_mask[i].bool()].tolist()
        text = tok.decode(prompt + s.completion_ids[i][attn].tolist(), skip_special_tokens=False)
        # the token sequence is exactly the chat template's rendering of the episode (up to the last EOS)
        rendered = prompt_text(tok, history[:-1]) + tok.decode(
            s.completion_ids[i][attn].tolist()[-int(_last_turn_length(trained)):], skip_special_tokens=False)
        assert text == rendered
        obs_ids = s.completion_ids[i][attn & ~trained].tolist()
        assert "result number 1" in tok.decode(obs_ids) and "result number 2" in tok.decode(obs_ids)
        assert (s.sampler_logprobs[i][~trained] == 0).all()


def _last_turn_length(trained: torch.Tensor) -> int:
    """Length of the final run of trained tokens."""
    idx = trained.nonzero().flatten().tolist()
    n = 1
    while n < len(idx) and idx[-n - 1] == idx[-n] - 1:
        n += 1
    return n


def test_training_forward_matches_the_sampler_through_observations(tiny):
    """Ratio 1 on every assistant token of every turn; zero log-prob (no loss) on observation tokens."""
    model, tok = tiny
    env = TwoObservations()
    tasks = list(env.tasks("test")[:3])
    torch.manual_seed(1)
    s, _ = sample_episodes(model, tok, env, tasks, max_turns=3, temperature=1.0, max_new_tokens=48)
    assert (s.completion_attention.bool() & ~s.completion_mask.bool()).any()  # there are observations
    with torch.no_grad():
        stats = score_completions(model, s.prompt_ids, s.prompt_mask, s.completion_ids, s.completion_mask,
                                  completion_attention=s.completion_attention)
        lp = stats.logprobs()
    m = s.completion_mask.bool()
    assert (lp - s.sampler_logprobs)[m].abs().max() < 1e-4
    assert (lp[~m] == 0).all()
    # a teacher re-scoring the whole interaction: a plain unpadded forward over the same tokens agrees
    for i in range(3):
        attn = s.completion_attention[i].bool()
        prompt = s.prompt_ids[i][s.prompt_mask[i].bool()].tolist()
        comp = s.completion_ids[i][attn].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + comp])).logits[0]
        ref = torch.log_softmax(logits[len(prompt) - 1:len(prompt) + len(comp) - 1], -1)
        ref = ref.gather(-1, torch.tensor(comp)[:, None]).squeeze(-1)
        got = lp[i][attn]
        trained = s.completion_mask[i][attn].bool()
        torch.testing.assert_close(got[trained], ref[trained], atol=1e-4, rtol=0)


def test_batch_selection_and_trimming_keep_observations(tiny):
    model, tok = tiny
    env = TwoObservations()
    tasks = list(env.tasks("test")[:2])
    s, _ = sample_episodes(model, tok, env, tasks, max_turns=3, temperature=0.0, max_new_tokens=64)
    batch = RolloutBatch(**vars(s), tasks=tasks, group=torch.arange(2), rewards=torch.zeros(2),
                         success=torch.zeros(2, dtype=torch.bool), feedback=["", ""])
    t = batch.select(torch.tensor([1])).trimmed()
    assert t.completion_attention is not None
    assert int(t.completion_attention.sum()) == int(s.completion_attention[1].sum())
    assert int(t.completion_mask.sum()) == int(s.completion_mask[1].sum())


def test_toolworld_episodes_reference_play_scores_one_and_bad_lookups_are_answered():
    env = ToolWorldEpisodes()
    base = ToolWorld()
    for task in env.tasks("test"):
        key = next(iter(task.meta["saved"]))
        assert f"my {key}" in task.meta["request"] and task.meta["tools"][0]["name"] == "lookup"
        history = list(task.messages) + [{"role": "assistant", "content": render_calls([Call("lookup", {"key": key})])}]
        obs = env.step(task, history)
        assert obs == [{"role": "tool", "content": task.meta["saved"][key]}]
        history += obs + [{"role": "assistant", "content": ToolWorld.reference(base, task)}]
        assert env.step(task, history) is None
        assert env.score_episode(task, history).success
    task = env.tasks("test")[0]
    wrong = list(task.messages) + [{"role": "assistant", "content": 'lookup(key="nothing")'}]
    assert "No saved detail" in env.step(task, wrong)[0]["content"]
