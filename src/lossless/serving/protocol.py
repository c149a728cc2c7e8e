"""The requests `lossless serve` accepts and the errors it answers with, in the OpenAI API's shapes.

Owns validation: a request body becomes a `ChatRequest` or `CompletionRequest` (pydantic), or an
`ApiError` with OpenAI's error object and an HTTP status. Fields the API has but this server does not
implement are refused by name (a client would otherwise get an answer to a different question); fields
it does not know are ignored, as OpenAI-compatible servers do, and logged. It does not decode.
"""

from __future__ import annotations

import json
import logging
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

SEED_MAX = 2**63 - 1
Number = Union[StrictInt, StrictFloat]  # JSON numbers only: true or "0.5" are not temperatures
MAX_STOPS = 4  # as the OpenAI API


# pydantic names the member of a union in an error's location; the API's users know only the field
TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}
ONE_OF = {"content": "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
          "stop": "a string or a list of strings", "prompt": "a string or a list of token ids",
          "logprobs": "a boolean or an integer"}


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                             429: "rate_limit_error"}.get(status, "invalid_request_error" if status < 500
                                                          else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LosslessOptions(_Strict):
    """The extension object `"lossless": {...}`: decoding settings a request may choose. Left out, each takes
    the server's default (which `lossless serve` took from its command line)."""

    mode: Literal["ar", "orthrus"] | None = None
    tree: StrictInt | None = Field(None, ge=0, le=64)
    lookup: StrictInt | None = Field(None, ge=0, le=64)
    k: StrictInt | None = Field(None, ge=1)
    cycle: Literal["two-pass", "fused"] | None = None
    top_k: StrictInt | None = Field(None, ge=0)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Request(BaseModel):
    """What chat and completion requests share."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    seed: StrictInt | None = Field(None, ge=0, le=SEED_MAX)
    stop: Union[StrictStr, list[StrictStr], None] = None
    n: StrictInt | None = Field(None, ge=1)  # null, as some clients send, is the default: 1
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # in the API, not implemented here: a request that asks for them is refused (see `unsupported`)
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict | None = None
    logprobs: Union[StrictBool, StrictInt, None] = None
    lossless: LosslessOptions | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop",
                           code="invalid_value")
        return [s for s in stops if s]

    def new_tokens(self) -> int | None:
        return self.max_tokens

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for every field set to something this server does not do."""
        out = []
        if self.n not in (None, 1):
            out.append(("n", "one choice per request (n=1)"))
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                out.append((name, "no penalties: they change what greedy decoding means"))
        if self.logit_bias:
            out.append(("logit_bias", "no logit bias"))
        if self.logprobs is not None and self.logprobs is not False:  # completions' 0 asks for the chosen token's
            out.append(("logprobs", "no log-probabilities"))
        return out

    def invalid(self) -> list[tuple[str, str]]:
        """(field, message) for fields whose values contradict each other, as OpenAI refuses them."""
        out = []
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "'stream_options' is only allowed when 'stream' is true"))
        return out


class ChatRequest(_Request):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list | None = None
    tool_choice: object = None
    response_format: dict | None = None
    top_logprobs: StrictInt | None = None

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.tools:
            out.append(("tools", "no tool calls"))
        if self.tool_choice not in (None, "none"):
            out.append(("tool_choice", "no tool calls"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "text responses only"))
        if self.top_logprobs:
            out.append(("top_logprobs", "no log-probabilities"))
        return out

    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them ("developer" is the system role)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Request):
    prompt: Union[StrictStr, list[StrictInt]]
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "the prompt is not echoed"))
        if self.suffix:
            out.append(("suffix", "no insertion"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "one candidate per request"))
        return out


def parse(kind: type[_Request], body: bytes) -> _Request:
    """The request in `body`, or an ApiError (400) naming the first field at fault."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc.__class__.__name__}: {exc})") from None
    except (ValueError, RecursionError) as exc:  # a number of thousands of digits, arrays nested thousands deep
        raise ApiError(400, f"the request body is JSON this server does not read ({str(exc)[:80]})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:  # "\ud800" escapes decode to lone surrogates, which no tokenizer or response can take
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the request holds a string that is not valid Unicode (a lone surrogate escape)") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    try:
        request = kind.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"] if not (isinstance(p, str) and (p in TYPE_TAGS or "[" in p))]
        param = ".".join(loc) or None
        message = f"must be {ONE_OF[loc[-1]]}" if loc and loc[-1] in ONE_OF else first["msg"]
        raise ApiError(400, f"'{param}': {message}" if param else message, param=param,
                       code="invalid_value") from None
    for field, why in request.unsupported():
        raise ApiError(400, f"'{field}' is not supported by this server ({why})", param=field, code="unsupported")
    for field, message in request.invalid():
        raise ApiError(400, message, param=field, code="invalid_value")
    if request.model_extra:  # one bounded, escaped line: the names are the client's text
        names = sorted(request.model_extra)
        shown = ", ".join(loggable(n, 40) for n in names[:LOGGED_FIELDS])
        more = f" and {len(names) - LOGGED_FIELDS} more" if len(names) > LOGGED_FIELDS else ""
        logging.getLogger("lossless.serve").info("ignored %d unknown request field%s: %s%s", len(names),
                                                 "s" if len(names) > 1 else "", shown, more)
    return request


LOGGED_FIELDS = 5  # unknown field names a log line shows


def loggable(text: str, limit: int) -> str:
    """`text` for a log line: control characters, quotes and backslashes escaped (no forged lines), at most `limit`
    characters of it (then "...")."""
    cut = text[:limit]
    escaped = cut.encode("unicode_escape").decode("ascii").replace('"', '\\"')
    return escaped + ("..." if len(text) > limit else "")
