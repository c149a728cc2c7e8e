"""The lm-evaluation-harness model `lossless`.

    lm_eval --model lossless --model_args model=smollm2-135m,mode=orthrus,dtype=bf16,attn=sdpa ...

`generate_until` decodes with `ar` or `orthrus` (the `mode` argument); `loglikelihood` and
`loglikelihood_rolling` score text through the AR view, so both modes give the same log-likelihoods.
Registered on import; `lm_eval` finds it by name through the start-up hook `src/_lossless_lm_eval.py`,
which installing the package puts in site-packages (the harness itself comes with `lossless[eval]`).

Owns the harness's model interface: request handling, stop strings, chat templates, the context window.
Does not know the tasks (`tasks.py`) or how `lossless eval` runs and summarises them
(`run.py`, `report.py`); decoding itself is `lossless.decoding.decode`.
"""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from ..decoding.loop import DecodeConfig, block_size, decode
from ..errors import LosslessError
from ..names import check_cycle, check_mode
from ..decoding.sampling import SamplingConfig
from ..text import StreamDecoder, cut_at_stops

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:  # pragma: no cover - exercised by the CLI's error path
    raise LosslessError("lm-evaluation-harness is not installed: pip install 'lossless[eval]'") from exc

log = logging.getLogger(__name__)


def _as_bool(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


@register_model("lossless")
class LosslessLM(TemplateLM):
    """An Orthrus model for the harness. Model arguments:

    model (smollm2-135m | dir | hub id), mode (ar | orthrus), dtype (fp32 | bf16 | fp16),
    attn (sdpa | eager | exact), head (path | none), k, cycle (two-pass | fused), groups, device,
    max_gen_toks (default 256), max_length (context window for log-likelihoods), seed (for sampled
    generation), progress (true | false). batch_size is accepted and ignored: one request at a time.
    """

    def __init__(self, model: str = "smollm2-135m", mode: str = "orthrus", dtype: str = "bf16", attn: str = "sdpa",
                 head: str | None = None, k: int | None = None, cycle: str = "two-pass", groups: int | None = None,
                 device: str = "cpu", max_gen_toks: int = 256, max_length: int | None = None, seed: int = 0,
                 progress=True, batch_size=1, **kwargs):
        super().__init__()
        from ..decoding.models import load_model

        check_mode(mode)
        check_cycle(cycle)
        try:
            bs = int(str(batch_size).split(":")[0]) if str(batch_size) != "auto" else 1
        except ValueError:
            raise LosslessError(f"batch_size must be an integer, got {batch_size!r}") from None
        if bs != 1:
            log.warning("lossless decodes one request at a time (batching would change the numerics); "
                        "batch_size=%s is ignored", batch_size)
        ignored = sorted(set(kwargs) - {"max_batch_size", "trust_remote_code", "pretrained"})
        if ignored:
            raise LosslessError(f"unknown model argument(s) {', '.join(ignored)}: see `help(lossless.evaluation.harness.LosslessLM)`")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's CLI passes cuda:0 unless told otherwise; like its own HF model, run on the CPU
            log.warning("device %s is not available here; using the CPU", device)
            device = "cpu"
        self.lm = load_model(model, dtype, device, attn, head=head, k=int(k) if k else None)
        if self.lm.tokenizer is None:
            raise LosslessError(f"{model} has no tokenizer; the harness needs one")
        self.tokenizer = self.lm.tokenizer
        self.model_name = str(model)
        self.mode = mode
        self.k = int(k) if k else None
        self.cycle, self.groups = cycle, int(groups) if groups else None
        self.block_size = block_size(self.lm.k, DecodeConfig(k=self.k, cycle=cycle))  # the k decoding uses
        self.max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length) if max_length else min(self.lm.max_positions, 4096)
        self.seed = int(seed)
        self.progress = _as_bool(progress)
        self.generations: list[dict] = []  # one entry per generate_until request: ids, text, stats

    # ---------------------------------------------------------------- what the harness asks of a model
    @property
    def eot_token_id(self) -> int:
        eos = self.lm.eos_token_ids()
        return eos[0] if eos else int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self.lm.device

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", self.model_name).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def get_model_info(self) -> dict:
        return {"lossless_model": self.model_name, "mode": self.mode, "dtype": self.lm.dtype_name,
                "attn": getattr(self.lm, "attn", None), "k": self.block_size, "cycle": self.cycle}

    # ------------------------------------------------------------------------------ log-likelihoods
    @torch.no_grad()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) under the AR view, and whether it is the greedy path."""
        n = len(continuation)
        if n == 0:
            return 0.0, True
        ids = (context + continuation)[-(self.max_length + 1):]  # the window the model can see
        logprobs, is_argmax = self.lm.score(ids[:-n], continuation)
        return float(logprobs.sum()), bool(is_argmax.all())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for key, context, continuation in tqdm(requests, desc=f"loglikelihood ({self.lm.dtype_name})",
                                               disable=disable_tqdm or not self.progress):
            res = self._score(list(context), list(continuation))
            self.cache_hook.add_partial("loglikelihood", key, res)
            out.append(res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in tqdm([r.args for r in requests], desc="loglikelihood_rolling",
                              disable=disable_tqdm or not self.progress):
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            total = sum(self._score(list(ctx), list(cont))[0] for ctx, cont in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # ---------------------------------------------------------------------------------- generation
    def _sampling(self, gen_kwargs: dict) -> SamplingConfig:
        temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0)
        if not _as_bool(gen_kwargs.get("do_sample", False)) or temperature <= 0:
            return SamplingConfig()
        return SamplingConfig(temperature=temperature, top_k=int(gen_kwargs.get("top_k", 0) or 0),
                              top_p=float(gen_kwargs.get("top_p", 1.0) or 1.0), seed=self.seed)

    def generate_one(self, context: str, gen_kwargs: dict) -> str:
        """Decode `context` (raw text; the harness applies any chat template) until a stop string."""
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
        prompt_ids = self.tok_encode(context)
        if not prompt_ids:
            prompt_ids = [self.prefix_token_id]
        room = self.lm.max_positions - max_new - self.block_size - 1
        if len(prompt_ids) > room:
            prompt_ids = prompt_ids[-room:]  # keep the end of an over-long context, as the harness's HF model does
        cfg = DecodeConfig(max_new_tokens=max_new, k=self.k, cycle=self.cycle, groups=self.groups,
                           sampling=self._sampling(gen_kwargs))
        stream = StreamDecoder(self.tokenizer)
        text_parts: list[str] = []

        def on_tokens(ids):
            text_parts.append(stream.push(ids))

        def stop(_state) -> bool:
            text = "".join(text_parts)
            return any(s and s in text for s in until)

        state = decode(self.lm, prompt_ids, self.mode, cfg, on_tokens=on_tokens, stop=stop if until else None)
        full = self.tokenizer.decode(state.generated, skip_special_tokens=True)
        text = cut_at_stops(full, until)
        self.generations.append({"mode": self.mode, "token_ids": state.generated, "text": text,
                                 "finish": state.finished, "stats": state.stats.to_dict()})
        return text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        bar = tqdm(requests, desc=f"generate_until ({self.mode}, {self.lm.dtype_name})",
                   disable=disable_tqdm or not self.progress)
        for req in bar:
            context, gen_kwargs = req.args
            text = self.generate_one(context, gen_kwargs)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
            s = self.generations[-1]["stats"]
            bar.set_postfix(tps=f"{s['tokens_per_step']:.2f}")
        return out
