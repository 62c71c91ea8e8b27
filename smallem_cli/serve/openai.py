"""OpenAI's request and response bodies: /v1/completions and /v1/chat/completions, whole or as server-sent events.
A request's fields are read as `smallem batch` reads a line's (their rules are `smallem generate`'s options), and
a field left out takes `smallem generate`'s default; a bad one is a 400 with OpenAI's error object."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

from tokenizers import Tokenizer

from .. import defaults, options
from ..engine.request import Finished, Request
from ..errors import BadField, UsageError
from ..model.chat import ChatFormat
from ..spec.sampling import Sampling

Body = dict[str, object]
# Every round looks for each stop string in the answer's tail: bounded, so that no request slows the others' rounds
MAX_STOPS, MAX_STOP_CHARS = 16, 1000


class ApiError(Exception):
    """A request answered with an error object: `status` 400, 401, 404, 405, 408, 413, 429, 431, 500 or 503."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> Body:
        kind = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
        error = {"message": str(self), "type": kind.get(self.status, "invalid_request_error")}
        return {"error": error | {"param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Served:
    """What a request is read against: the model's name, tokenizer, chat format and context."""

    model: str
    tok: Tokenizer
    chat: ChatFormat
    vocab_size: int
    max_len: int
    slack: int  # draft tokens a verify pass may hold past the answer (`options.check_context`)
    max_chars: int  # a prompt's characters at most, checked before it is tokenized (`prompt_chars`)


def prompt_chars(tok: Tokenizer, max_len: int) -> int:
    """The most characters a prompt of `max_len` tokens can have: a token stands for at most its vocabulary entry's
    characters (a byte-level or byte-fallback entry, `<0xE2>`, for at least what it decodes to), so a longer text holds
    more tokens than the context. (`_check_chars` counts a normalizer's output; no causal model drops whitespace.)"""
    return max_len * max((len(t) for t in tok.get_vocab(with_added_tokens=True)), default=1)


def model_card(served: Served) -> Body:
    return {"id": served.model, "object": "model", "created": 0, "owned_by": "smallem", "max_model_len": served.max_len}


@dataclass(frozen=True)
class Job:
    request: Request  # the engine's; its id is the answer's
    chat: bool
    stream: bool
    include_usage: bool


# fields OpenAI defines that smallem does not do: refused unless they ask for the default
_ONLY = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False, 0),
         "top_logprobs": (None, 0), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
         "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []),
         "tool_choice": (None, "none")}  # fmt: skip
# OpenAI's name -> smallem's (read by `options.READERS`), in the order they are read; `null` takes the default
_FIELDS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"} | {
    n: n for n in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop")
}


def read_job(raw: bytes, served: Served, chat: bool, index: int) -> Job:
    """A completion's or chat completion's body -> its checked Job (its Request numbered `index`), or ApiError(400)
    naming the bad field: the work of a request before the engine (JSON, the template, the tokenizer), which the
    server runs off its event loop."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    if (model := body.get("model")) is not None and model != served.model:
        why = f"unknown model {options.shown(model)}: this server has {served.model!r}"
        raise ApiError(400, why, "model", "model_not_found")
    for name, allowed in _ONLY.items():
        if name in body and body[name] not in allowed:
            raise ApiError(400, f"{name} {options.shown(body[name])} is not supported (only {allowed[-1]!r})", name)
    given: dict[str, Any] = {}
    try:
        for name, ours in _FIELDS.items():
            if body.get(name) is not None:
                given[ours] = options.READERS[ours](name, body[name])
        stop = given.pop("stop", ())
        if len(stop) > MAX_STOPS or any(len(x) > MAX_STOP_CHARS for x in stop):
            raise BadField(f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
        # ignore_eos, an extension (vLLM's too): answers of max_tokens, whatever the model says
        stream, ignore_eos = _flag(body, "stream"), _flag(body, "ignore_eos")
        stream_options = body.get("stream_options")
        if stream_options is not None and not isinstance(stream_options, dict):
            raise BadField(f"stream_options must be an object, got {options.shown(stream_options)}")
        include_usage = _flag(stream_options or {}, "include_usage")
        max_new = given.pop("max_new_tokens", defaults.MAX_NEW_TOKENS)
        sampling = replace(Sampling(), **given)
        options.check_sampling(**asdict(sampling), max_new_tokens=max_new)
        ids = _chat_ids(body, served) if chat else _prompt_ids(body, served)
        options.check_context(len(ids), max_new, served.slack, served.max_len)
    except BadField as e:
        raise ApiError(400, str(e)) from None
    except UsageError as e:
        raise ApiError(400, options.field_message(e).replace("max_new_tokens", "max_tokens")) from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    request = Request(index, rid, tuple(ids), max_new, sampling, stop, ignore_eos=ignore_eos)
    return Job(request, chat, stream, include_usage)


def _flag(body: Body, name: str) -> bool:
    value = body.get(name, False)
    if value is not None and type(value) is not bool:
        raise BadField(f"{name} must be true or false, got {options.shown(value)}")
    return bool(value)


def _prompt_ids(body: Body, served: Served) -> list[int]:
    """A prompt: a string, or token ids (or a list of one of either: one prompt a request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(i) is int for i in prompt):
        if len(prompt) > served.max_len:
            raise BadField(f"the prompt ({len(prompt)} tokens) is longer than the model's context ({served.max_len})")
        if not all(0 <= i < served.vocab_size for i in prompt):  # type: ignore[operator]
            raise BadField(f"prompt token ids must be in 0..{served.vocab_size - 1}")
        return list(prompt)  # type: ignore[arg-type]
    if not isinstance(prompt, str):
        raise BadField(f"prompt must be a string or token ids (one prompt a request), got {options.shown(prompt)}")
    if not prompt.strip():
        raise BadField("empty prompt")
    _check_chars([prompt], served)
    return options.prompt_ids(served.tok, prompt)


def _chat_ids(body: Body, served: Served) -> list[int]:
    messages = options.conversation(body.get("messages"))
    if served.chat.template is None:
        raise BadField(f"the model {served.model!r} has no chat template: use /v1/completions")
    _check_chars([m["content"] for m in messages], served)  # its tokens are at least its messages' (as text)
    return options.prompt_ids(served.tok, None, served.chat, messages)


def _check_chars(texts: list[str], served: Served) -> None:
    """BadField where `texts` cannot fit the context whatever their tokens (`prompt_chars`): a prompt of megabytes
    is refused in microseconds, never tokenized (which takes the GIL, and memory, in proportion)."""
    if (n := sum(map(len, texts))) <= served.max_chars:
        return
    norm = served.tok.normalizer
    if norm is not None and len(norm.normalize_str("".join(texts))) <= served.max_chars:
        return
    raise BadField(f"the prompt ({n} characters) is longer than the model's context of {served.max_len} tokens")


# responses
def _head(job: Job, model: str, chunk: bool) -> Body:
    kind = ("chat.completion" if job.chat else "text_completion") + (".chunk" if job.chat and chunk else "")
    return {"id": job.request.id, "object": kind, "created": int(time.time()), "model": model}


def _counts(job: Job, fin: Finished) -> Body:
    """`usage`, and `smallem`: the speculation's statistics (an extension field)."""
    prompt, tokens = len(job.request.prompt), len(fin.tokens)
    usage = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
    return {"usage": usage, "smallem": fin.stats}


def whole(job: Job, model: str, fin: Finished) -> Body:
    if job.chat:
        choice: Body = {"index": 0, "message": {"role": "assistant", "content": fin.text}, "finish_reason": fin.reason}
    else:
        choice = {"index": 0, "text": fin.text, "logprobs": None, "finish_reason": fin.reason}
    return _head(job, model, False) | {"choices": [choice]} | _counts(job, fin)


def chunk(job: Job, model: str, text: str | None, finish: str | None = None) -> str:
    """One server-sent event of a streamed answer (text None: the chat's opening role delta)."""
    if job.chat:
        delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
        choice: Body = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return event(_head(job, model, True) | {"choices": [choice]})


def usage_chunk(job: Job, model: str, fin: Finished) -> str:
    return event(_head(job, model, True) | {"choices": []} | _counts(job, fin))


def event(body: Body | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"
