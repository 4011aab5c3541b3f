"""The experience bank: persistence, crash safety under a real kill, retrieval and its exclusion rules."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from lopd.latent.experience_bank import Experience, ExperienceBank

DIM = 8


def _unit(rng, n):
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _exp(i, success=True, group="g", step=1, reward=None):
    return Experience(f"t{i}", f"task {i}", f"answer {i}", float(success) if reward is None else reward, success,
                      step=step, group=group)


def test_add_persist_reload(tmp_path):
    rng = np.random.default_rng(0)
    bank = ExperienceBank(DIM, tmp_path)
    keys = _unit(rng, 5)
    ids = bank.add([_exp(i) for i in range(5)], keys)
    assert ids == list(range(5))
    again = ExperienceBank(DIM, tmp_path)
    assert again.size == 5 and [e.trajectory for e in again.entries] == [f"answer {i}" for i in range(5)]
    np.testing.assert_array_equal(again.keys, keys)


def test_retrieval_is_cosine_top_k_with_exclusions():
    rng = np.random.default_rng(1)
    bank = ExperienceBank(DIM)
    keys = _unit(rng, 6)
    bank.add([_exp(0, group="a"), _exp(1, group="a"), _exp(2, group="b"), _exp(3, success=False, group="b"),
              _exp(4, group="c"), _exp(5, group="c")], keys)
    query = keys[[0]]
    # brute-force reference: cosine similarity to every success
    order = [int(i) for i in np.argsort(-(keys @ query[0])) if bank.entries[i].success]
    found = bank.search(query, 3)
    assert found.index[0] == order[:3]
    np.testing.assert_allclose(found.similarity[0], (keys @ query[0])[order[:3]], rtol=1e-6)
    # never the trajectory itself, never its own group, no failures unless asked
    found = bank.search(query, 6, exclude_ids=[[0]], exclude_groups=["a"])
    assert 0 not in found.index[0] and 1 not in found.index[0] and 3 not in found.index[0]
    assert sorted(found.index[0]) == [2, 4, 5]
    found = bank.search(query, 6, exclude_groups=["a"], successes_only=False)
    assert 3 in found.index[0]
    assert bank.search(query, 6, min_similarity=1.01).index == [[]]


def test_capacity_evicts_oldest_and_survives_reload(tmp_path):
    rng = np.random.default_rng(2)
    bank = ExperienceBank(DIM, tmp_path, capacity=3)
    bank.add([_exp(i) for i in range(5)], _unit(rng, 5))
    assert bank.size == 3
    found = bank.search(bank.keys, 5)
    assert all(i >= 2 for row in found.index for i in row)
    again = ExperienceBank(DIM, tmp_path, capacity=3)
    assert again.size == 3 and not again.alive[:2].any()


def test_lowest_reward_eviction():
    rng = np.random.default_rng(3)
    bank = ExperienceBank(DIM, capacity=2, eviction="lowest_reward")
    bank.add([_exp(0, reward=0.9), _exp(1, reward=0.1), _exp(2, reward=0.5)], _unit(rng, 3))
    assert bank.alive.tolist() == [True, False, True]


def test_truncate_after_forgets_redone_steps(tmp_path):
    rng = np.random.default_rng(4)
    bank = ExperienceBank(DIM, tmp_path)
    bank.add([_exp(i, step=1 + i // 2) for i in range(6)], _unit(rng, 6))
    bank.truncate_after(2)
    assert [e.step for e in bank.entries] == [1, 1, 2, 2]
    assert ExperienceBank(DIM, tmp_path).size == 4


def test_torn_tail_is_dropped_on_load(tmp_path):
    rng = np.random.default_rng(5)
    bank = ExperienceBank(DIM, tmp_path)
    bank.add([_exp(i) for i in range(3)], _unit(rng, 3))
    with open(tmp_path / "keys.f32", "ab") as f:  # a key that landed for an entry that did not
        f.write(_unit(rng, 1).tobytes()[:20])
    with open(tmp_path / "entries.jsonl", "a") as f:
        f.write('{"task_id": "t9", "task_te')  # a torn line
    again = ExperienceBank(DIM, tmp_path)
    assert again.size == 3
    again.add([_exp(7)], _unit(rng, 1))  # appending after repair keeps keys and lines aligned
    third = ExperienceBank(DIM, tmp_path)
    assert third.size == 4 and third.entries[3].trajectory == "answer 7"
    np.testing.assert_array_equal(third.keys[3], again.keys[3])


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from lopd.latent.experience_bank import Experience, ExperienceBank
    bank = ExperienceBank(8, sys.argv[1])
    rng = np.random.default_rng(0)
    i = bank.size
    print("ready", flush=True)
    while True:
        keys = rng.standard_normal((4, 8)).astype(np.float32)
        keys /= np.linalg.norm(keys, axis=1, keepdims=True)
        bank.add([Experience(f"t{i + j}", "x" * 2000, "y" * 2000, 1.0, True, step=i + j) for j in range(4)], keys)
        i += 4
""")


def test_bank_survives_a_writer_killed_mid_append(tmp_path):
    """A real subprocess appending in a loop, killed with SIGKILL at random moments, several times."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    folder = tmp_path / "bank"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    rng = np.random.default_rng(0)
    sizes = []
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.05, 0.4)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        bank = ExperienceBank(8, folder)  # must load
        n = len(bank.entries)
        assert len(bank.keys) == n and bank.size == n
        assert [e.task_id for e in bank.entries] == [f"t{i}" for i in range(n)]  # no hole, no duplicate
        np.testing.assert_allclose(np.linalg.norm(bank.keys, axis=1), 1.0, rtol=1e-5)
        sizes.append(n)
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0] > 0


@pytest.mark.parametrize("bad", ["fifo2", "random"])
def test_bad_eviction_is_an_error(bad):
    with pytest.raises(ValueError, match="eviction"):
        ExperienceBank(DIM, eviction=bad)


def test_distinct_search_never_returns_the_same_experience_twice():
    """A group's identical successes share their task's key: without `distinct` they fill all k places."""
    bank = ExperienceBank(2)
    same = [Experience("t0", "book a flight", "book(x=1)", 1.0, True, group="1:0") for _ in range(5)]
    other = [Experience("t1", "book a train", "train(x=2)", 1.0, True, group="1:1"),
             Experience("t2", "book a bus", "bus(x=3)", 1.0, True, group="1:2")]
    keys = np.array([[1.0, 0.0]] * 5 + [[0.8, 0.6], [0.6, 0.8]], dtype=np.float32)
    bank.add(same + other, keys)
    query = np.array([[1.0, 0.0]], dtype=np.float32)
    assert set(bank.search(query, 3).index[0]) <= {0, 1, 2, 3, 4}  # three copies of one experience
    found = bank.search(query, 3, distinct=True)
    assert found.index[0][0] in range(5) and found.index[0][1:] == [5, 6]
    assert found.similarity[0] == pytest.approx([1.0, 0.8, 0.6])
    assert len(bank.search(query, 5, distinct=True).index[0]) == 3  # fewer than k distinct: all of them


def test_retrieval_metrics_count_same_category_and_same_task_hits():
    from types import SimpleNamespace

    from lopd.envs.base import Task
    from lopd.latent.experience_bank import Retrieved
    from lopd.latent.memory import ExperienceMemory

    bank = ExperienceBank(DIM)
    rng = np.random.default_rng(2)
    bank.add([Experience("t0", "task 0", "a", 1.0, True, category="add"),
              Experience("t1", "task 1", "b", 1.0, True, category="mul")], _unit(rng, 2))
    memory = object.__new__(ExperienceMemory)  # the metrics read only the bank
    memory.bank = bank
    tasks = [Task("t0", (), None, "add"), Task("t2", (), None, "add"), Task("t3", (), None, "add")]
    # t0 retrieves itself (a revisit), t2 a same-category other task, t3 only another category
    found = Retrieved([[0], [1, 0], [1]], [[0.9], [0.5, 0.4], [0.2]])
    m = memory.metrics(SimpleNamespace(tasks=tasks), found)
    assert m["context/retrieval_hit"] == pytest.approx(2 / 3)
    assert m["context/retrieval_same_task"] == pytest.approx(1 / 3)
    assert m["context/retrieved_per_task"] == pytest.approx(4 / 3)
    assert m["context/retrieval_similarity"] == pytest.approx((0.9 + 0.5 + 0.4 + 0.2) / 4)
