"""`lopd pretrain-compressor` (lopd/latent/pretrain.py): the corpus costs no env reward and never shows a
train/val/test/transfer tool, the context distillation lowers the KL it trains on, a stopped pretraining
resumes bit for bit, and LOPD starts from the file `algorithm.lopd.compressor_init` names (or says in one
line why it cannot)."""

import json
import math
import sys

import pytest
import torch

import zygote
from conftest import THREADS

from lopd.config import load_config
from lopd.envs.base import DataError
from lopd.envs.toolworld import ToolWorld, ToolWorldConfig, compressor_examples
from lopd.errors import ConfigError
from lopd.latent.pretrain import PretrainSettings, load_compressor, new_compressor, pretrain_compressor, read_corpus


def test_the_toolworld_corpus_shows_only_sft_pool_tools_with_same_tool_calls_as_context():
    examples = list(compressor_examples(64, seed=0, k=2))
    assert examples == list(compressor_examples(64, seed=0, k=2))  # deterministic
    world = ToolWorld(ToolWorldConfig(seed=0))
    known = {t.name for pool in ("train", "transfer") for t in world.tools(pool)}
    requested_shown = 0
    for messages, context in examples:
        system = messages[0]["content"]
        shown = {line.split("(")[0].strip("- ").strip() for line in system.splitlines()[1:] if "(" in line}
        assert shown and not shown & known, shown & known
        lines = context.splitlines()
        assert lines[0] == "Successful calls for similar requests:" and len(lines) == 3
        called = {line.split(" -> ")[1].split("(")[0] for line in lines[1:]}
        assert called <= shown
        requested_shown += bool(called)
    assert requested_shown == len(examples)
    # not the tiny policy's SFT examples: another stream
    from lopd.envs.toolworld import sft_examples
    assert {m[1]["content"] for m, _ in examples}.isdisjoint({m[1]["content"] for m, _, _ in sft_examples(64, seed=0)})


def test_a_bad_corpus_row_is_one_line_naming_file_and_line(tmp_path):
    cfg = load_config("lopd_compressor")
    good = {"messages": [{"role": "user", "content": "hi"}], "context": "use f(x=1)"}
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "messages": "hi"}) + "\n")
    with pytest.raises(DataError, match=r"corpus.jsonl:2: 'messages' must be"):
        read_corpus(PretrainSettings(corpus=str(path), held_out=0), cfg)
    path.write_text(json.dumps({**good, "context": ""}) + "\n")
    with pytest.raises(DataError, match=r"corpus.jsonl:1: 'context' must be a non-empty string"):
        read_corpus(PretrainSettings(corpus=str(path), held_out=0), cfg)
    path.write_text(json.dumps(good) + "\n")
    with pytest.raises(DataError, match="1 rows, but 4 are held out"):
        read_corpus(PretrainSettings(corpus=str(path), held_out=4), cfg)
    assert read_corpus(PretrainSettings(corpus=str(path), held_out=0), cfg) == [(({"role": "user", "content": "hi"},), "use f(x=1)")]


CFG = ["algorithm.lopd.latent_tokens=4", f"train.threads={THREADS}", "rollout.max_new_tokens=24"]
SMALL = dict(prompts_per_step=3, group=2, held_out=4, eval_every=3, save_every=3, corpus_size=32, lr=3e-3)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """One uninterrupted pretraining of 6 steps, and one stopped after 3 and resumed to 6."""
    cfg = load_config("lopd_compressor", CFG)
    whole = tmp_path_factory.mktemp("whole")
    meta = pretrain_compressor(cfg, PretrainSettings(steps=6, **SMALL), whole)
    split = tmp_path_factory.mktemp("split")
    assert pretrain_compressor(cfg, PretrainSettings(steps=6, **SMALL), split, stop_after=3) is None
    assert not (split / "compressor.pt").exists()
    pretrain_compressor(cfg, PretrainSettings(steps=6, **SMALL), split)
    return cfg, whole, split, meta


def test_context_distillation_lowers_the_held_out_kl_ratio(pretrained):
    cfg, whole, _, meta = pretrained
    rows = [json.loads(line) for line in (whole / "pretrain.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss/cd"] >= 0 for r in rows)
    assert 0 < meta["held_out_kl_ratio"] < meta["held_out_kl_ratio_at_start"], meta
    # the cosine schedule by hand: lr * (0.1 + 0.9 * (1 + cos(pi * step / 6)) / 2) at steps 0..5
    expected = [3e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * s / 6))) for s in range(6)]
    assert [r["lr"] for r in rows] == pytest.approx(expected, rel=1e-12)


def test_a_stopped_pretraining_resumes_bit_for_bit(pretrained):
    _, whole, split, _ = pretrained
    a, b = (torch.load(d / "compressor.pt", weights_only=True) for d in (whole, split))
    assert a["held_out_kl_ratio"] == b["held_out_kl_ratio"]
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    assert (whole / "pretrain.jsonl").read_text().splitlines()[-1].split('"seconds"')[0] == \
        (split / "pretrain.jsonl").read_text().splitlines()[-1].split('"seconds"')[0]
    with pytest.raises(ConfigError, match="holds a pretraining of other settings"):
        pretrain_compressor(pretrained[0], PretrainSettings(steps=6, **{**SMALL, "lr": 1e-4}), whole)


def test_lopd_starts_from_the_pretrained_compressor(pretrained, tmp_path):
    from conftest import session_for

    cfg, whole, _, _ = pretrained
    path = whole / "compressor.pt"
    session = session_for(CFG + [f"algorithm.lopd.compressor_init={path}"], config="lopd_compressor")
    saved = torch.load(path, weights_only=True)["state_dict"]
    got = session.algorithm.composer.state_dict()
    assert set(got) == set(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    fresh = new_compressor(cfg, 4).state_dict()
    assert not torch.equal(fresh["memory"], saved["memory"])  # pretraining moved it
    # a file of another K, or none, is one line naming the key
    with pytest.raises(ConfigError, match=r"compressor_init: .* writes 4 slots, but algorithm.lopd.latent_tokens is 8"):
        load_compressor(new_compressor(cfg, 8), path, cfg.model.name)
    with pytest.raises(ConfigError, match="was trained for model 'tiny', this run's is 'smollm2-135m'"):
        load_compressor(new_compressor(cfg, 4), path, "smollm2-135m")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="junk.pt: not a compressor file"):
        load_compressor(new_compressor(cfg, 4), tmp_path / "junk.pt", "tiny")
    out = zygote.run([sys.executable, "-m", "lopd.cli", "train", "--config", "lopd_compressor", *CFG,
                          f"run.dir={tmp_path / 'run'}", f"algorithm.lopd.compressor_init={tmp_path / 'none.pt'}"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "algorithm.lopd.compressor_init:" in out.stderr and "no such file" in out.stderr
    assert "tiny-k16" in out.stderr  # the bundled names are offered
    # the bundled compressor of the tiny policy loads by name, at its K
    record = load_compressor(new_compressor(cfg, 16), "tiny-k16", "tiny")
    assert record["latent_tokens"] == 16 and record["held_out_kl_ratio"] < record["held_out_kl_ratio_at_start"]
