"""Prompt text -> token ids (chat template, empty system message), and generated ids -> text.

The same encoding is used by `generate`, the audit and the benchmarks, so every comparison starts
from identical prompt ids.
"""

from __future__ import annotations

from .errors import LosslessError


def encode_prompt(tokenizer, prompt: str, chat_template: bool = True) -> list[int]:
    """Token ids of `prompt`: with the chat template (empty system message where the template takes
    one, thinking off where it has that switch), else the raw text."""
    if tokenizer is None:
        raise LosslessError("this model has no tokenizer: pass token ids, or a model directory with a tokenizer")
    if not prompt or not prompt.strip():
        raise LosslessError("the prompt is empty: give some text to continue")
    if not chat_template or not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    user = [{"role": "user", "content": prompt}]
    for messages in ([{"role": "system", "content": ""}, *user], user):
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                                tokenize=True, return_dict=False)
        except Exception:  # templates that reject a system role
            continue
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    raise LosslessError("the model's chat template failed on this prompt; try --no-chat-template")


class StreamDecoder:
    """Turns committed id chunks into text increments, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta
