"""The experience bank: persistence, crash safety under a real kill, retrieval and its exclusion rules."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict

import numpy as np
import pytest

from lopd.errors import LopdError
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


# ---------------------------------------------------------------- files that disagree, full and read-only disks


def _bank(folder, n, rng, step=1):
    bank = ExperienceBank(DIM, folder)
    bank.add([_exp(i, step=step) for i in range(n)], _unit(rng, n))
    return bank


def _files(folder):
    return (folder / "entries.jsonl").read_bytes(), (folder / "keys.f32").read_bytes()


def test_keys_cut_short_with_every_entry_checkpointed_is_refused_naming_keys(tmp_path):
    _bank(tmp_path, 6, np.random.default_rng(10))
    with open(tmp_path / "keys.f32", "r+b") as f:
        f.truncate(6 * DIM * 4 - 5)
    before = _files(tmp_path)
    for checkpointed in (6, None):
        with pytest.raises(LopdError) as e:
            ExperienceBank(DIM, tmp_path, checkpointed=checkpointed)
        msg = str(e.value)
        assert "\n" not in msg and "keys.f32: 187 bytes hold 5 keys of 8 floats and 27 bytes, for 6 entries" in msg
        assert "refusing to drop" in msg
        assert _files(tmp_path) == before  # nothing rewritten
    look = ExperienceBank(DIM, tmp_path, readonly=True)  # a look reads what both files hold, and says so
    assert len(look.entries) == 5 and "keys.f32" in look.disagreement and _files(tmp_path) == before


def test_a_torn_append_beyond_the_checkpoint_is_repaired_keeping_checkpointed_entries_bit_for_bit(tmp_path):
    rng = np.random.default_rng(11)
    _bank(tmp_path, 5, rng)
    lines, keys = _files(tmp_path)
    new = [json.dumps({**asdict(_exp(5 + i, step=2)), "id": 5 + i}) + "\n" for i in range(3)]
    with open(tmp_path / "keys.f32", "ab") as f:  # an append of 3 killed midway: every key, 2 lines and a half
        f.write(_unit(rng, 3).tobytes())
    with open(tmp_path / "entries.jsonl", "a") as f:
        f.write(new[0] + new[1] + new[2][:30])
    bank = ExperienceBank(DIM, tmp_path, checkpointed=5)
    assert len(bank.entries) == 7 and "torn line" in bank.disagreement
    after = _files(tmp_path)
    assert after[0] == lines + (new[0] + new[1]).encode() and after[1][:len(keys)] == keys
    assert len(after[1]) == 7 * DIM * 4
    # keys cut short past the checkpoint: entries without a key are dropped, the checkpointed ones stay
    with open(tmp_path / "keys.f32", "r+b") as f:
        f.truncate(6 * DIM * 4 + 3)
    bank = ExperienceBank(DIM, tmp_path, checkpointed=5)
    assert [e.task_id for e in bank.entries] == [f"t{i}" for i in range(6)]
    assert _files(tmp_path) == (lines + new[0].encode(), after[1][:6 * DIM * 4])
    bank.add([_exp(9, step=3)], _unit(rng, 1))
    assert ExperienceBank(DIM, tmp_path, checkpointed=5).entries[6].task_id == "t9"  # still aligned


def test_a_torn_last_line_beyond_the_count_is_repaired(tmp_path):
    rng = np.random.default_rng(12)
    _bank(tmp_path, 4, rng)
    lines, keys = _files(tmp_path)
    with open(tmp_path / "entries.jsonl", "ab") as f:
        f.write(b'{"evict": 1')  # a tombstone in flight
    bank = ExperienceBank(DIM, tmp_path, checkpointed=4)
    assert len(bank.entries) == 4 and bank.alive.all() and "ends in 11 bytes of a torn line" in bank.disagreement
    assert _files(tmp_path) == (lines, keys)


def test_a_bank_with_fewer_entries_than_checkpointed_is_refused(tmp_path):
    _bank(tmp_path, 4, np.random.default_rng(13))
    with pytest.raises(LopdError, match=r"entries.jsonl: 4 entries and 4 keys: refusing to drop an entry the last "
                                        r"checkpoint holds \(6\)"):
        ExperienceBank(DIM, tmp_path, checkpointed=6)
    assert len(ExperienceBank(DIM, tmp_path, checkpointed=4).entries) == 4


def test_a_damaged_line_is_refused_unless_only_unchecked_entries_follow_it(tmp_path):
    _bank(tmp_path, 5, np.random.default_rng(14))
    text = (tmp_path / "entries.jsonl").read_text().splitlines(keepends=True)
    text[3] = "garbage\n"
    (tmp_path / "entries.jsonl").write_text("".join(text))
    with pytest.raises(LopdError, match=r"entries.jsonl: 3 entries \(.*entries.jsonl:4 is not a JSON line"):
        ExperienceBank(DIM, tmp_path)
    assert len(ExperienceBank(DIM, tmp_path, checkpointed=3).entries) == 3


def test_a_rewrite_killed_between_its_renames_is_finished_or_undone(tmp_path):
    rng = np.random.default_rng(15)
    old, new = tmp_path / "old", tmp_path / "new"
    _bank(old, 6, rng)
    shutil.copytree(old, new)
    ExperienceBank(DIM, new).truncate_after(0)  # the rewrite, done: no entries left
    _bank(new, 2, rng, step=0)
    # killed after keys.f32 was renamed, before entries.tmp was: the rewrite is finished on open
    crashed = tmp_path / "crashed"
    shutil.copytree(old, crashed)
    shutil.copy(new / "keys.f32", crashed / "keys.f32")
    shutil.copy(new / "entries.jsonl", crashed / "entries.tmp")
    assert len(ExperienceBank(DIM, crashed, readonly=True).entries) == 2
    assert len(ExperienceBank(DIM, crashed).entries) == 2 and _files(crashed) == _files(new)
    assert not (crashed / "entries.tmp").exists()
    # killed before any rename: the old files stand, the temporary ones go
    shutil.copy(new / "keys.f32", old / "keys.tmp")
    (old / "entries.tmp").write_text('{"task_id": "t0", "task_')
    assert len(ExperienceBank(DIM, old).entries) == 6 and not list(old.glob("*.tmp"))


def test_compaction_keeps_the_written_count_a_checkpoint_records(tmp_path):
    rng = np.random.default_rng(16)
    bank = ExperienceBank(DIM, tmp_path, capacity=2)
    bank.add([_exp(i) for i in range(1005)], _unit(rng, 1005))  # 1003 evicted: compacted to the 2 left
    assert len(bank.entries) == 2 and bank.written == 1005
    again = ExperienceBank(DIM, tmp_path, capacity=2, checkpointed=1005)
    assert again.written == 1005 and [e.task_id for e in again.entries] == ["t1003", "t1004"]


def test_a_full_disk_during_an_append_is_one_line(tmp_path):
    bank = _bank(tmp_path, 2, np.random.default_rng(17))
    (tmp_path / "keys.f32").unlink()
    (tmp_path / "keys.f32").symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(LopdError, match=r"^no space left on device while writing .*keys.f32") as e:
        bank.add([_exp(2)], _unit(np.random.default_rng(0), 1))
    assert "\n" not in str(e.value)


RO_WRITER = textwrap.dedent("""
    import sys, numpy as np
    from lopd.errors import LopdError
    from lopd.latent.experience_bank import Experience, ExperienceBank
    bank = ExperienceBank(8, sys.argv[1])
    try:
        bank.add([Experience("t9", "x", "y", 1.0, True)], np.eye(8, dtype=np.float32)[:1])
    except LopdError as e:
        print("error:", e)
""")


@pytest.mark.skipif(shutil.which("unshare") is None or subprocess.run(
    ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode != 0,
    reason="needs unprivileged user and mount namespaces (unshare)")
def test_a_read_only_disk_during_an_append_is_one_line(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    (tmp_path / "writer.py").write_text(RO_WRITER)
    py = f"{sys.executable} {tmp_path / 'writer.py'} {disk / 'bank'}"
    make = f"{sys.executable} -c 'from lopd.latent.experience_bank import ExperienceBank; ExperienceBank(8, \"{disk / 'bank'}\")'"
    command = f"mount -t tmpfs tmpfs {disk} && {make} && mount -o remount,ro {disk} && {py}"
    out = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip().endswith("keys.f32: cannot write (read-only file system)"), out.stdout + out.stderr[-2000:]
    assert len(out.stdout.strip().splitlines()) == 1


def test_lopd_bank_says_in_one_line_that_the_files_disagree(tmp_path, capsys):
    from lopd.cli import main

    folder = tmp_path / "run" / "bank"
    bank = ExperienceBank(384, folder)
    rng = np.random.default_rng(18)
    keys = rng.standard_normal((3, 384)).astype(np.float32)
    bank.add([_exp(i) for i in range(3)], keys / np.linalg.norm(keys, axis=1, keepdims=True))
    with open(folder / "keys.f32", "r+b") as f:
        f.truncate(3 * 384 * 4 - 5)
    before = _files(folder)
    assert main(["bank", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "files disagree" in err and "keys.f32" in err and "shown: the 2 entries" in err
    assert "2 live entries" in out and _files(folder) == before  # read, not repaired


def test_retrieval_keys_restrict_the_candidates_then_rank_by_request(tmp_path):
    """`algorithm.retrieval.key`: task_tools finds only the experiences that called one of the tools the task
    offers (ranked by request similarity, the tools kept across a reload), category only the task's own
    category; request finds any. A task that offers no tools falls back to any."""
    from types import SimpleNamespace

    from lopd.latent.memory import allowed
    from lopd.schema import RetrievalKey

    rng = np.random.default_rng(3)
    keys = _unit(rng, 4)
    bank = ExperienceBank(DIM, tmp_path)
    calls = [["book_flight"], ["run_washer"], ["book_flight", "set_alarm"], []]
    bank.add([Experience(f"t{i}", f"task {i}", f"answer {i}", 1.0, True, group=f"g{i}", category=c, tools=t)
              for i, (c, t) in enumerate(zip(["book_flight", "run_washer", "book_flight", "other"], calls))], keys)
    bank = ExperienceBank(DIM, tmp_path)  # reloaded: the tools index is rebuilt from the entries
    assert bank.calling(["book_flight"]) == [0, 2] and bank.calling(["set_alarm", "run_washer"]) == [1, 2]
    task = SimpleNamespace(category="book_flight", meta={"tools": [{"name": "book_flight"}, {"name": "set_alarm"}]})
    plain = SimpleNamespace(category="other", meta={})
    assert allowed(bank, [task, plain], RetrievalKey.task_tools) == [[0, 2], None]
    assert allowed(bank, [task], RetrievalKey.category) == [[0, 2]]
    assert allowed(bank, [task], RetrievalKey.request) is None
    query = keys[[1]]  # most similar to entry 1, which did not call the task's tools
    assert bank.search(query, 1).index == [[1]]
    found = bank.search(query, 4, only=[[0, 2]])
    sims = keys[[0, 2]] @ keys[1]
    assert found.index == [[0, 2] if sims[0] >= sims[1] else [2, 0]]  # the allowed ones, by request similarity
    assert bank.search(query, 4, only=[[]]).index == [[]]
