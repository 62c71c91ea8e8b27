"""What the user typed, checked: each bad value becomes one clear `UsageError` line."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import defaults
from .errors import BadField, UsageError, first_fault, one_line

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenizers import Tokenizer

    from .config import ModelConfig
    from .model.chat import ChatFormat


# A request's fields (`smallem batch`'s lines, `smallem serve`'s JSON bodies), read as the options are checked
def shown(value: object, limit: int = 40) -> str:
    """A field's value as JSON, cut short: an error line stays short whatever was sent."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def int_field(name: str, value: object) -> int:
    if type(value) is not int:  # bool is an int to Python, not to a user
        raise BadField(f"{name} must be an integer, got {shown(value)}")
    return value


def number_field(name: str, value: object) -> float:
    if type(value) not in (int, float):
        raise BadField(f"{name} must be a number, got {shown(value)}")
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:  # an integer beyond any float
        raise BadField(f"{name} is out of range, got {shown(value)}") from None


def stop_field(name: str, value: object) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadField(f"stop must be a string or a list of strings, got {shown(value)}")
    if "" in stops:
        raise BadField("stop strings must not be empty")
    return tuple(stops)


# How a request's fields (smallem's names, in the order they are read) are read: as the options of the same names
READERS: dict[str, Callable[[str, object], object]] = {
    "max_new_tokens": int_field, "temperature": number_field, "top_k": int_field, "top_p": number_field,
    "min_p": number_field, "repetition_penalty": number_field, "seed": int_field, "stop": stop_field,
}  # fmt: skip

# options' messages name the command line's options: a request names its fields ("--min-p": "min_p")
_OPTIONS = ("--max-new-tokens", "--seed", "top-k", "top-p", "--min-p", "--repetition-penalty")


def field_message(e: UsageError) -> str:
    """A message of options' (the rules of `smallem generate`), told of a request's fields."""
    msg = str(e)
    for option in _OPTIONS:
        msg = msg.replace(option, option.lstrip("-").replace("-", "_"))
    return msg


def parse_ks(text: str) -> list[int]:
    """'2', '1,3,5' or '1..6' -> sorted k values, each in 1..MAX_K (checked before a range is built)."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split(".."))
            if lo > hi:
                raise UsageError(f"bad k range {text!r}: the first k is larger than the last")
            bounds = [lo, hi]
        else:
            bounds = [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"bad k list {text!r}: use 2, 1,3,5 or 1..6") from None
    if not bounds or not all(1 <= k <= defaults.MAX_K for k in bounds):
        raise UsageError(f"k values must be between 1 and {defaults.MAX_K}: {text!r}")
    return list(range(bounds[0], bounds[1] + 1)) if ".." in text else sorted(set(bounds))


def _ints(text: str, bad: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (empty items skipped), or UsageError(bad)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(bad) from None


def parse_sizes(text: str) -> list[int]:
    """'1,4,16,64' -> batch sizes, each >= 1, in the order given."""
    sizes = _ints(text, f"bad --batch {text!r}: use sizes such as 1,4,16,64")
    if not sizes:
        raise UsageError(f"--batch needs sizes such as 1,4,16,64, got {text!r}")
    if min(sizes) < 1:
        raise UsageError(f"batch sizes must be >= 1: {text!r}")
    return sizes


def read_prompt(prompt: str | None) -> str:
    """The prompt argument, or stdin for `-` or for no argument on a pipe; not empty."""
    if prompt is None and sys.stdin.isatty():
        raise UsageError("no prompt: give one as an argument, or pipe it on stdin")
    text = prompt if prompt is not None and prompt != "-" else sys.stdin.buffer.read()
    try:
        text = text.decode("utf-8") if isinstance(text, bytes) else text
    except UnicodeDecodeError as e:
        raise UsageError(f"stdin is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


def pick_k(proposer: str, k: int | None, greedy: bool) -> int:
    """The proposals per round: the user's k (1..MAX_K), else the proposer's default; `none`'s is 0."""
    if k is not None and not 1 <= k <= defaults.MAX_K and not (proposer == "none" and k == 0):
        raise UsageError(f"k must be between 1 and {defaults.MAX_K}, got {k}")
    return defaults.default_k(proposer, greedy, k)


def slack(proposer: str, k: int | None) -> int:
    """The draft tokens a verify pass may hold past an answer, in either mode (a request of `batch` or `serve` picks its
    temperature): what `check_context` leaves room for."""
    return max(pick_k(proposer, k, True), pick_k(proposer, k, False))


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, seed: int = 0,
                   min_p: float | None = None, repetition_penalty: float = 1.0, stops: list[str] | None = None,
                   max_new_tokens: int = 1) -> None:  # fmt: skip
    """The generation options, checked before anything loads (or stdin is awaited)."""
    low, high = defaults.MIN_PENALTY, defaults.MAX_PENALTY
    first_fault(
        (max_new_tokens < 1, f"--max-new-tokens must be >= 1, got {max_new_tokens}"),
        (not temperature >= 0, f"temperature must be >= 0, got {temperature}"),
        (not math.isfinite(temperature), f"temperature must be >= 0 and finite, got {temperature}"),
        (
            0 < temperature < defaults.MIN_TEMPERATURE,
            f"temperature {temperature} is too small: below {defaults.MIN_TEMPERATURE} the logits divided by it "
            "overflow to infinity; use 0 for greedy decoding",
        ),
        (top_k is not None and top_k < 1, f"top-k must be >= 1, got {top_k}"),
        (top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1), f"top-p must be in (0, 1], got {top_p}"),
        (
            min_p is not None and not (math.isfinite(min_p) and 0 <= min_p < 1),
            f"--min-p must be in [0, 1), got {min_p}",
        ),
        (  # NaN too
            not low <= repetition_penalty <= high,
            f"--repetition-penalty must be between {low:g} and {high:g} (1 = off), got {repetition_penalty}",
        ),
        (stops is not None and "" in stops, "--stop needs a string that is not empty"),
        (not 0 <= seed <= defaults.MAX_SEED, f"--seed must be between 0 and 2^63-1, got {seed}"),
    )


def read_prompts(path: Path, cfg: ModelConfig, max_new: int, ks: dict[str, list[int]],
                 tokenizer: Tokenizer | None = None, chat: ChatFormat | None = None) -> list[list[int]]:  # fmt: skip
    """`bench`'s prompts file, a JSON object a line: its "tokens", else its "text" (by `tokenizer`), else its
    "messages" (by `chat`'s template); each leaves room for max_new tokens and the largest k's pass."""
    try:
        with open(path, "rb") as f:  # bounded: a device such as /dev/zero never ends
            raw = f.read(defaults.MAX_PROMPTS_BYTES + 1)
        if len(raw) > defaults.MAX_PROMPTS_BYTES:
            raise UsageError(f"prompts file {path} is larger than {defaults.MAX_PROMPTS_BYTES >> 20} MiB")
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UsageError(f"prompts file {path} is not valid UTF-8 (byte {e.start})") from None
    except FileNotFoundError:
        raise UsageError(f"prompts file not found: {path} (run `smallem prompts`)") from None
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path}: {e.strerror or e}") from None
    top_k = max((k for v in ks.values() for k in v), default=0)
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        ids = _line_ids(json_value(line), where, cfg.vocab_size, tokenizer, chat)
        try:
            check_context(len(ids), max_new, top_k, cfg.max_seq_len)
        except UsageError as e:
            raise UsageError(f"{where}: {e}") from None
        prompts.append(ids)
    if not prompts:
        raise UsageError(f"prompts file {path} holds no prompt")
    return prompts


def conversation(value: object) -> list[dict[str, str]]:
    """A request's "messages" -> the conversation [{"role", "content"}], a content given as OpenAI's text parts
    joined; BadField naming the fault."""
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise BadField('"messages" must be a list of {"role": ..., "content": ...} objects, not empty')
    out = []
    for i, m in enumerate(value, 1):
        content = m.get("content")
        if isinstance(content, list):  # parts: text ones only
            if not all(isinstance(p, dict) and p.get("type") == "text" and type(p.get("text")) is str for p in content):
                raise BadField(f"message {i}: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise BadField(f'message {i}: its "role" and "content" must be strings')
        out.append({"role": m["role"], "content": content})
    return out


def json_value(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _line_ids(obj: object, where: str, vocab_size: int, tok: Tokenizer | None, chat: ChatFormat | None) -> list[int]:
    """A prompts file's line (parsed) -> its prompt's ids, or UsageError naming `where` and the fault."""
    if not isinstance(obj, dict) or not {"tokens", "text", "messages"} & obj.keys():
        raise UsageError(
            f'{where}: not a prompt (a JSON object with "tokens" (ids in 0..{vocab_size - 1}), "text" (a string) '
            'or "messages" (a list of {"role": ..., "content": ...}))'
        )
    if "tokens" in obj:
        ids = obj["tokens"]
        if not isinstance(ids, list) or not ids or not all(type(i) is int and 0 <= i < vocab_size for i in ids):
            raise UsageError(f'{where}: not a prompt (a JSON object whose "tokens" are ids in 0..{vocab_size - 1})')
        return ids
    if "text" in obj and "messages" in obj:
        raise UsageError(f'{where}: a prompt is "text" or "messages", not both')
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise UsageError(f'{where}: "text" must be a string, got {type(obj["text"]).__name__}')
        if not obj["text"].strip():
            raise UsageError(f'{where}: "text" is empty')
    else:
        try:
            obj = {"messages": conversation(obj["messages"])}
        except BadField as e:
            raise UsageError(f"{where}: {e}") from None
        if chat is None or chat.template is None:
            raise UsageError(f'{where}: the target has no chat template: give this prompt as "text" or "tokens"')
    if tok is None:
        raise UsageError(f'{where}: a "text" or "messages" prompt needs the tokenizer of the target')
    try:
        return prompt_ids(tok, obj.get("text"), chat, obj.get("messages"))
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None


def prompt_ids(
    tok: Tokenizer, text: str | None, chat: ChatFormat | None = None, messages: list[dict[str, str]] | None = None
) -> list[int]:
    """A text (the tokenizer's special tokens added as it adds them), or else a conversation through the chat
    template -> its ids; UsageError (one line) where the template or the tokenizer refuses it, or it has none."""
    from .model.chat import ChatError, chat_ids
    from .model.tokenizer import TokenizerError, encode

    try:
        if text is not None:
            ids = encode(tok, text)
        else:
            assert chat is not None and messages is not None, "a text, or a conversation and its format"
            ids = chat_ids(tok, chat, messages)
    except (ChatError, TokenizerError) as e:  # the template's refusal, or the tokenizer's
        raise UsageError(one_line(str(e))) from None
    if not ids:
        raise UsageError("the prompt encodes to no tokens")
    return ids


def check_context(prompt_tokens: int, max_new: int, k: int, ctx: int) -> None:
    if prompt_tokens + max_new + k + 1 > ctx:
        raise UsageError(
            f"prompt ({prompt_tokens} tokens) + --max-new-tokens {max_new} + k+1 exceeds "
            f"the model's context of {ctx} tokens"
        )


def threads(n: int | None) -> int | None:
    """--threads: None (torch's default) or 1 to the CPUs this process may run on (more share a core)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if n is not None and not 1 <= n <= cpus:
        raise UsageError(f"--threads must be between 1 and {cpus} (the CPUs this process may use), got {n}")
    return n


LOADAVG = Path("/proc/loadavg")


def threads_for_load(cores: int) -> int | None:
    """`generate`'s default threads: None (all cores), or the cores other running processes (/proc/loadavg)
    leave, at least 1: a descheduled thread stalls every barrier (docs/benchmarks.md, "Threads")."""
    try:
        busy = int(LOADAVG.read_text().split()[3].split("/")[0]) - 1  # less this process
    except (OSError, ValueError, IndexError):
        return None
    return max(1, cores - busy) if busy > 0 and cores > 1 else None


def tree(value: int) -> tuple[int, int] | None:
    """--tree: 0 (the chain) or a count of draft tokens per tree, 1..MAX_TREE -> (budget, width)."""
    if not 0 <= value <= defaults.MAX_TREE:
        raise UsageError(f"--tree must be in 0..{defaults.MAX_TREE} (0: a chain of draft tokens), got {value}")
    return (value, defaults.TREE_WIDTH) if value else None


def tree_budgets(text: str) -> list[int]:
    """bench --tree: "12" or "8,16,24" -> the budgets, each checked as `tree` checks one."""
    budgets = _ints(text, f"--tree takes budgets like 12 or 8,16,24, got {text!r}")
    for b in budgets:
        if tree(b) is None:
            raise UsageError(f"--tree must be in 1..{defaults.MAX_TREE} for bench rows, got {b}")
    return budgets


def weights_list(text: str) -> list[str]:
    """bench --proposer-weights: "int8", or "int8,f16" (rows for the second as well)."""
    got = [w.strip() for w in text.split(",") if w.strip()]
    if not 1 <= len(got) <= len(defaults.WEIGHTS) or len(set(got)) < len(got) or not set(got) <= set(defaults.WEIGHTS):
        raise UsageError(
            f"--proposer-weights takes {', '.join(defaults.WEIGHTS)} or both, comma-separated, got {text!r}"
        )
    return got


def proposer_vocab(greedy: bool, chosen: int | None) -> int:
    if chosen is not None and chosen < 0:
        raise UsageError(f"--proposer-vocab must be >= 0, got {chosen}")
    return defaults.proposer_vocab(greedy, chosen)


def check_bench(modes: str, repeats: int, max_new: int, peer: str | None, plot: bool) -> list[str]:
    """`bench`'s options -> its modes. Optional extras are checked before minutes of timing."""
    mode_list = [m for m in modes.split(",") if m]
    if not set(mode_list) <= {"greedy", "sample"} or not mode_list:
        raise UsageError(f"modes must be greedy and/or sample, got {modes!r}")
    if repeats < 1 or max_new < 1:
        raise UsageError("--repeats and --max-new-tokens must be >= 1")
    if peer not in (None, "hf", "llamacpp", "vllm"):
        raise UsageError(f"unknown peer {peer!r}: use hf (transformers), llamacpp (llama.cpp) or vllm (vLLM)")
    needs = {"hf": ("transformers",), "llamacpp": ("llama_cpp", "gguf")}.get(peer or "", ())
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"--peer {peer} needs {' and '.join(missing)}: pip install 'smallem[{peer}]'")
    if plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'smallem[plot]'")
    return mode_list
