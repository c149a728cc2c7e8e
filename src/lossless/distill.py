"""Self-distillation data: the frozen model's own greedy responses to a prompt set, cached on disk.

Responses are generated in left-padded batches with Hugging Face `generate` (greedy, chat template as
in `lossless generate`) and appended to a JSONL file one record per prompt, so an interrupted run
resumes where it stopped. Records: `{"id", "prompt_ids", "response_ids"}`.

Also checks that training prompts are disjoint from an audit suite (normalised text equality), and
reads plain-text training data (`text_records`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from .errors import LosslessError
from .jsonio import read_jsonl
from .model import OrthrusLM
from .text import encode_prompt


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def read_prompts(path: str | Path) -> list[dict]:
    """Prompts from JSONL lines `{"id"?, "prompt"}`; ids default to `<file stem>-<line>`."""
    path = Path(path)
    rows = []
    for i, obj in enumerate(read_jsonl(path, what="prompt file"), 1):
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


def load_records(path: str | Path) -> list[dict]:
    """Completed records of a distillation file; a torn last line (killed run) is ignored."""
    path = Path(path)
    return read_jsonl(path, skip_bad_lines=True) if path.exists() else []


@torch.no_grad()
def generate_responses(model: OrthrusLM, prompts: list[dict], out_path: str | Path, max_new_tokens: int = 128,
                       batch_size: int = 16, progress: bool = True) -> list[dict]:
    """Greedy responses for every prompt not yet in `out_path`; returns all records."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in load_records(out_path)}
    todo = [p for p in prompts if p["id"] not in done]
    # longest prompts together: less padding per batch
    encoded = sorted(((p["id"], encode_prompt(model.tokenizer, p["prompt"])) for p in todo), key=lambda x: len(x[1]))
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else model.eos_token_ids()[0]
    eos = model.eos_token_ids()
    bar = tqdm(total=len(encoded), desc="self-distillation responses", unit="prompt", disable=not progress)
    with open(out_path, "a", encoding="utf-8") as f:
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start:start + batch_size]
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch], device=model.device)
            attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch], device=model.device)
            out = model.backbone.generate(input_ids=input_ids, attention_mask=attention, do_sample=False,
                                          max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
            for (pid, ids), row in zip(batch, out[:, width:].tolist()):
                response = []
                for tok in row:
                    response.append(tok)
                    if tok in eos:
                        break
                f.write(json.dumps({"id": pid, "prompt_ids": ids, "response_ids": response}) + "\n")
            f.flush()
            bar.update(len(batch))
    bar.close()
    return load_records(out_path)


def records_path(model: str, prompts: str | Path, max_new_tokens: int) -> Path:
    """Where the self-distillation responses of `model` to a prompt file are cached."""
    from .models import cache_dir

    return cache_dir() / "distill" / f"{Path(model).name}__{Path(prompts).stem}__{max_new_tokens}.jsonl"


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
    return files


def text_records(paths: list[str], tokenizer, chunk: int = 256) -> list[dict]:
    """Plain-text training data: files, directories of .txt, or JSONL with a 'text' field, chunked."""
    records = []
    for f in text_files(paths):
        if f.suffix == ".jsonl":
            texts = []
            for i, obj in enumerate(read_jsonl(f, what="--data file"), 1):
                if not isinstance(obj.get("text"), str):
                    raise LosslessError(f"{f}: record {i}: expected a JSON object with a \"text\" field")
                texts.append(obj["text"])
        else:
            texts = [f.read_text(encoding="utf-8")]
        for text in texts:
            ids = tokenizer(text)["input_ids"]
            for s in range(0, max(len(ids) - 8, 1), chunk):
                piece = ids[s:s + chunk]
                if len(piece) > 8:
                    records.append({"id": f"{f.name}:{s}", "prompt_ids": piece[:1], "response_ids": piece[1:]})
    return records
