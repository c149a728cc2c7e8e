"""Self-distillation data: the frozen model's own greedy responses to a prompt set, kept as records.

Responses are generated in left-padded batches with Hugging Face `generate` (greedy, chat template as
in `lossless generate`) into a record store (`records.RecordStore`): one record per prompt,
`{"key": prompt id, "prompt_ids", "response_ids"}`, appended after every batch and rolled into gzip
segments, so an interrupted run resumes where it stopped, on this machine or, from committed segments,
on another. Several processes (`--shard`, or ranks under `accelerate launch`) split the prompts.
`meta.json` names what the responses are (model, dtype, length, prompt file); a directory is never
filled from two different set-ups.

Also checks that training prompts are disjoint from an audit suite (normalised text equality), and
reads plain-text training data (`text_records`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import LosslessError, not_utf8, read_utf8
from ..jsonio import read_jsonl
from ..paths import write_atomically
from ..decoding.model import OrthrusLM
from ..study.records import RecordStore, read_records, writer_name
from ..text import encode_prompt

META = "meta.json"


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def read_prompts(path: str | Path) -> list[dict]:
    """Prompts from JSONL lines `{"id"?, "prompt"}`; ids default to `<file stem>-<line>`."""
    path = Path(path)
    rows = []
    try:
        objs = read_jsonl(path, what="prompt file")
    except UnicodeDecodeError as exc:
        raise not_utf8(path, exc, "prompt file") from None
    for i, obj in enumerate(objs, 1):
        if not isinstance(obj.get("prompt"), str):
            raise LosslessError(f"{path}: record {i}: expected a JSON object with a \"prompt\" field")
        rows.append({"id": str(obj.get("id", f"{path.stem}-{i}")), "prompt": obj["prompt"]})
    return rows


def check_disjoint(train_prompts: list[str], suite_prompts: list[str], what: str = "the audit suite") -> None:
    """Refuse training prompts that also appear in an evaluation suite."""
    overlap = {normalise(p) for p in train_prompts} & {normalise(p) for p in suite_prompts}
    if overlap:
        example = next(iter(overlap))[:60]
        raise LosslessError(
            f"{len(overlap)} training prompts also appear in {what} (e.g. '{example}'); remove them from the training data"
        )


def load_records(out_dir: str | Path) -> list[dict]:
    """The responses a distillation directory holds (segments and plain files; a torn last line ignored)."""
    return read_records(out_dir) if Path(out_dir).is_dir() else []


def _sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _read_meta_file(path: Path) -> dict:
    """A `meta.json`, or a one-line error when it is unreadable (e.g. emptied by a full disk)."""
    try:
        meta = json.loads(read_utf8(path, "responses' meta file"))
    except json.JSONDecodeError as exc:
        meta = exc
    if not isinstance(meta, dict):
        raise LosslessError(f"{path} is corrupt (not a JSON object): delete it and rerun the `lossless distill` that made "
                            "the directory; its responses are kept")
    return meta


def check_meta(out_dir: str | Path, model: str, dtype: str, max_new_tokens: int, prompts: str | Path) -> dict:
    """The meta a set-up gives `out_dir`; refuses a directory holding responses of another set-up (or an
    unreadable meta.json). Writes nothing."""
    out_dir = Path(out_dir)
    meta = {"model": Path(model).name, "dtype": dtype, "max_new_tokens": max_new_tokens,
            "prompts": Path(prompts).name, "prompts_sha256": _sha(prompts)}
    path = out_dir / META
    if path.is_file():
        have = _read_meta_file(path)
        diff = [f"{k} {have.get(k)!r} != {v!r}" for k, v in meta.items() if have.get(k) != v]
        if diff:
            raise LosslessError(f"{out_dir} holds responses of another set-up ({'; '.join(diff)}); choose another directory")
    return meta


def open_distillation(out_dir: str | Path, model: str, dtype: str, max_new_tokens: int, prompts: str | Path) -> dict:
    """Write `meta.json` on first use; afterwards refuse a different set-up in the same directory."""
    out_dir = Path(out_dir)
    meta = check_meta(out_dir, model, dtype, max_new_tokens, prompts)
    path = out_dir / META
    if not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(meta, indent=2) + "\n")
    return meta


def read_meta(out_dir: str | Path) -> dict:
    path = Path(out_dir) / META
    if not path.exists():
        raise LosslessError(f"{out_dir} holds no responses: make them with `lossless distill --out {out_dir}`")
    return _read_meta_file(path)


def check_model(out_dir: str | Path, model: str) -> dict:
    """The meta of a distillation directory holding responses of `model`; refuses another model's."""
    meta = read_meta(out_dir)
    if meta.get("model") != Path(model).name:
        raise LosslessError(f"{out_dir} holds responses of {meta.get('model')}, not {Path(model).name}: make them "
                            f"with `lossless distill --model {model}`")
    return meta


def check_source(out_dir: str | Path, prompts: str | Path) -> dict:
    """The meta of a distillation directory made from the prompt file `prompts`; refuses anything else."""
    meta = read_meta(out_dir)
    if meta.get("prompts_sha256") != _sha(prompts):
        raise LosslessError(f"{out_dir} holds responses to another prompt file than {prompts}; pass the --prompts "
                            f"it was made from ({meta.get('prompts')})")
    return meta


@torch.no_grad()
def generate_responses(model: OrthrusLM, prompts: list[dict], out_dir: str | Path, max_new_tokens: int = 128,
                       batch_size: int = 16, progress: bool = True, shard: tuple[int, int] = (0, 1),
                       roll_seconds: float = 600.0) -> int:
    """Greedy responses for this shard's prompts not yet in `out_dir`. Returns how many were written."""
    done = {r["key"] for r in load_records(out_dir)}
    i, n = shard
    todo = [p for j, p in enumerate(prompts) if j % n == i and p["id"] not in done]
    # prompts of similar length together: less padding per batch
    encoded = sorted(((p["id"], encode_prompt(model.tokenizer, p["prompt"])) for p in todo), key=lambda x: len(x[1]))
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else model.eos_token_ids()[0]
    eos = model.eos_token_ids()
    store = RecordStore(out_dir, writer_name(shard), roll_seconds=roll_seconds)
    written = 0
    with store.session(), tqdm(total=len(encoded), desc="self-distillation responses", unit="prompt",
                               disable=not progress) as bar:
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start:start + batch_size]
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch], device=model.device)
            attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch], device=model.device)
            out = model.backbone.generate(input_ids=input_ids, attention_mask=attention, do_sample=False,
                                          max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
            records = []
            for (pid, ids), row in zip(batch, out[:, width:].tolist()):
                response = []
                for tok in row:
                    response.append(tok)
                    if tok in eos:
                        break
                records.append({"key": pid, "prompt_ids": ids, "response_ids": response})
            store.append(records)
            written += len(records)
            bar.update(len(batch))
    return written


def default_dir(model: str, prompts: str | Path, max_new_tokens: int, dtype: str) -> Path:
    """Where responses go when no directory is named: the user cache (`--distill-dir` keeps them in a checkout)."""
    from ..paths import cache_dir

    return cache_dir() / "distill" / f"{Path(model).name}__{Path(prompts).stem}__{max_new_tokens}__{dtype}"


def text_files(paths: list[str]) -> list[Path]:
    """The files behind `--data`: files as given, directories as their *.txt files (sorted)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.rglob("*.txt")))
        elif p.exists():
            files.append(p)
        else:
            raise LosslessError(f"--data {p}: no such file or directory")
    for f in files:  # text that does not decode is refused now, not after the model has loaded
        read_utf8(f, "--data file")
    return files


def text_records(paths: list[str], tokenizer, chunk: int = 256) -> list[dict]:
    """Plain-text training data: files, directories of .txt, or JSONL with a 'text' field, chunked."""
    records = []
    for f in text_files(paths):
        if f.suffix == ".jsonl":
            texts = []
            try:
                objs = read_jsonl(f, what="--data file")
            except UnicodeDecodeError as exc:
                raise not_utf8(f, exc, "--data file") from None
            for i, obj in enumerate(objs, 1):
                if not isinstance(obj.get("text"), str):
                    raise LosslessError(f"{f}: record {i}: expected a JSON object with a \"text\" field")
                texts.append(obj["text"])
        else:
            texts = [read_utf8(f, "--data file")]
        for text in texts:
            ids = tokenizer(text)["input_ids"]
            for s in range(0, max(len(ids) - 8, 1), chunk):
                piece = ids[s:s + chunk]
                if len(piece) > 8:
                    records.append({"id": f"{f.name}:{s}", "prompt_ids": piece[:1], "response_ids": piece[1:]})
    return records
