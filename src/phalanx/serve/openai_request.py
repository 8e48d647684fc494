"""Validation of OpenAI-style request bodies (pure: JSON value in, typed request or BadRequest out)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from phalanx.serve.errors import BadRequest, UnknownModel
from phalanx.serve.sampling import SamplingParams
from phalanx.workload.corpus import CharVocab

STOP_STRINGS_MAX = 4


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    resumed_text: str  # phalanx extension: text already streamed by another replica (router failover)


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"'{name}' must be {want}, got {type(v).__name__}", param=name)
    return v


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = float(_field(body, name, (int, float), default))
    if not (lo <= v <= hi) or math.isnan(v):
        raise BadRequest(f"'{name}' must be between {lo} and {hi}, got {v}", param=name)
    return v


def chat_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", param="messages")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}] must be an object with string 'role' and 'content'", param="messages")
        parts.append(f"{m['role']}: {m['content']}\n")
    return "".join(parts) + "assistant: "


def parse_completion(body: Any, chat: bool, model_name: str, vocab: CharVocab, context: int) -> CompletionRequest:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest("'model' is required and must be a string", param="model")
    if model != model_name:
        raise UnknownModel(f"model '{model}' does not exist; this server serves '{model_name}' (GET /v1/models)")
    if chat:
        prompt = chat_prompt(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string (or a list of one string)", param="prompt")
    if not prompt:
        raise BadRequest("prompt is empty", param="prompt")
    unknown = sorted(set(prompt) - set(vocab.chars))
    if unknown:
        raise BadRequest(f"prompt contains characters outside the model's vocabulary: {unknown[:5]!r}", param="prompt")
    max_tokens_name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _field(body, max_tokens_name, (int,), 16)
    if max_tokens < 1:
        raise BadRequest(f"'{max_tokens_name}' must be at least 1, got {max_tokens}", param=max_tokens_name)
    if len(prompt) >= context:
        raise BadRequest(f"prompt is {len(prompt)} tokens; this model's context is {context} tokens", param="prompt")
    if len(prompt) + max_tokens > context:
        raise BadRequest(f"prompt ({len(prompt)} tokens) + {max_tokens_name} ({max_tokens}) exceeds the context of "
                         f"{context} tokens; lower {max_tokens_name} to at most {context - len(prompt)}",
                         param=max_tokens_name)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise BadRequest("'top_p' must be greater than 0", param="top_p")
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= STOP_STRINGS_MAX:
        stops = tuple(stop)
    elif stop is not None:
        raise BadRequest(f"'stop' must be a string or a list of up to {STOP_STRINGS_MAX} strings", param="stop")
    if any(s == "" for s in stops):
        raise BadRequest("'stop' strings must not be empty", param="stop")
    seed = _field(body, "seed", (int,), 0)
    if not -(2**63) <= seed < 2**63:
        raise BadRequest("'seed' must fit in 64 bits", param="seed")
    n = _field(body, "n", (int,), 1)
    if n != 1:
        raise BadRequest("only n=1 is supported", param="n")
    stream = _field(body, "stream", (bool,), False)
    opts = _field(body, "stream_options", (dict,), {})
    include_usage = bool(opts.get("include_usage", False))
    resumed = _field(body, "phalanx_resume_text", (str,), "")
    if set(resumed) - set(vocab.chars) or len(resumed) > max_tokens:
        raise BadRequest("'phalanx_resume_text' must be vocabulary text no longer than max_tokens",
                         param="phalanx_resume_text")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stops, seed=seed)
    return CompletionRequest(chat, prompt, vocab.encode(prompt), params, stream, include_usage, resumed)
