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
    return encode_messages(tokenizer, [{"role": "user", "content": prompt}])


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the model's chat template, ready for the assistant's turn. A
    conversation without a system message gets an empty one where the template takes it (so one user message
    encodes as `encode_prompt` encodes its text), thinking off where the template has that switch."""
    if tokenizer is None:
        raise LosslessError("this model has no tokenizer: pass token ids, or a model directory with a tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise LosslessError("this model has no chat template: send a raw prompt to the completions route instead")
    tries = [messages] if any(m["role"] == "system" for m in messages) else \
        [[{"role": "system", "content": ""}, *messages], messages]
    for conversation in tries:
        try:
            ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, enable_thinking=False,
                                                tokenize=True, return_dict=False)
        except Exception:  # templates that reject a system role
            continue
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    raise LosslessError("the model's chat template failed on these messages; try a raw prompt without the template")


def cut_at_stops(text: str, stops: list[str]) -> str:
    """The text before the earliest stop string (lm-eval's convention)."""
    for s in stops:
        if s:
            text = text.split(s)[0]
    return text


class StopCutter:
    """Releases streamed text so that no stop string is ever sent: it holds back the last characters that
    could begin one, and cuts at the first stop string the text holds. The text released over a stream is the
    whole answer, so a streamed and a non-streamed answer to one request are the same string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text, self.released, self.stopped = "", 0, False

    def push(self, delta: str) -> str:
        """Text that can be sent now, after `delta` arrived; sets `stopped` once a stop string appeared."""
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self.hold)  # a stop string found now ends inside `delta`
        self.text += delta
        if any(s in self.text[start:] for s in self.stops):
            self.text, self.stopped = cut_at_stops(self.text, self.stops), True
            return self.flush()
        return self._release(len(self.text) - self.hold)

    def flush(self) -> str:
        """Everything not yet sent (the stream has ended)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        out, self.released = self.text[self.released:upto], upto
        return out


class StreamDecoder:
    """Turns committed id chunks into text increments, holding back incomplete UTF-8 sequences, in time linear
    in the ids (prefix and read offsets): each push decodes only the ids from `prefix` on, where `prefix` is where
    the previous increment's window began. Decoding from a few ids back, not from the unread ids alone, gives
    tokenizers whose decode depends on neighbours (a SentencePiece word's leading space dropped at the start of
    a text) the same context on both sides of the difference taken, so the increments add up to the decode of all
    the ids, as re-decoding everything on every push did. (A decode that cleans up spaces before punctuation across
    tokens, `clean_up_tokenization_spaces`, can change text already sent: no stream adds up there, this one or
    re-decoding everything; the engine then answers with what it streamed.)"""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the window's start; the ids before `read` have been sent as text

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        if len(self.ids) == self.read:
            return ""
        sent = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        text = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(text) <= len(sent) or text.endswith("\ufffd"):  # nothing new yet, or a character still incomplete
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(sent):]
