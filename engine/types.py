"""Typed objects that cross the engine boundary (server -> engine -> server).

The server builds a GenerationRequest (with SamplingParams validated at construction) and
reads RequestOutput deltas from the engine; it never sees the scheduler's Request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from deltaserve.engine.errors import InvalidRequestError  # the server imports it from here
from deltaserve.engine.structured.spec import Constraint

MAX_TOP_LOGPROBS = 20


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; validated once here. Written by the server."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # multiplicative, on prompt + generated tokens
    presence_penalty: float = 0.0  # additive, on generated tokens (OpenAI semantics)
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # False: this request never drafts, even where the engine speculates (--speculative)
    speculative: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Constraint | None = None  # output grammar (engine/structured/spec.py)
    # Thinking budget (forced_token): once this many tokens were generated inside
    # thinking (the prompt opened `<think>`) without `</think>`, the row is made to write
    # thinking_close_ids ("\n</think>\n\n", the server's tokenizer) and then answers.
    # None: unlimited. thinking_end_id: `</think>`, one of thinking_close_ids.
    max_thinking_tokens: int | None = None
    thinking_close_ids: tuple[int, ...] = ()
    thinking_end_id: int | None = None

    def forced_token(self, output_ids: Sequence[int]) -> int | None:
        """The token a row with these parameters must write after `output_ids` instead of
        sampling, or None.

        The thinking budget: output starts inside thinking, so once max_thinking_tokens
        tokens were generated without `</think>` among them, the next steps write
        thinking_close_ids one token each (a pure function of output_ids, which hold every
        earlier token when a step samples, pipelined or not). A constrained row's forcing
        ends at `</think>`: its grammar starts there and owns every later token.
        """
        if self.max_thinking_tokens is None:
            return None
        j = len(output_ids) - self.max_thinking_tokens  # position in the close sequence
        close = self.thinking_close_ids
        if not 0 <= j < len(close):
            return None
        if self.thinking_end_id in output_ids[: self.max_thinking_tokens]:
            return None  # the model closed its thinking within the budget
        if self.constraint is not None and self.thinking_end_id in close[:j]:
            return None
        return close[j]

    def may_force_within(self, output_ids: Sequence[int], count: int) -> bool:
        """Whether one of the next `count` tokens after `output_ids` may be forced
        (forced_token). A speculative verify writes up to k + 1 tokens at once and forces
        none, so a row with a thinking budget drafts only in steps where this is False."""
        if self.max_thinking_tokens is None:
            return False
        budget = self.max_thinking_tokens
        if self.thinking_end_id in output_ids[:budget]:
            return False
        written = len(output_ids)
        return written + count > budget and written < budget + len(self.thinking_close_ids)

    def __post_init__(self) -> None:
        finite = all(
            math.isfinite(v)
            for v in (self.temperature, self.top_p, self.min_p, self.repetition_penalty)
        )
        _check(finite, "sampling parameters must be finite numbers", "temperature")
        _check(0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]", "temperature")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(self.top_k >= 0, "top_k must be >= 0 (0 disables it)", "top_k")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p")
        _check(
            0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty must be in (0, 10]",
            "repetition_penalty",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty must be in [-2, 2]",
            "presence_penalty",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty must be in [-2, 2]",
            "frequency_penalty",
        )
        for token, bias in self.logit_bias.items():
            _check(
                isinstance(token, int) and token >= 0,
                "logit_bias keys must be token ids",
                "logit_bias",
            )
            _check(
                math.isfinite(bias) and -100 <= bias <= 100,
                "logit_bias values must be in [-100, 100]",
                "logit_bias",
            )
        _check(self.max_tokens >= 1, "max_tokens must be >= 1", "max_tokens")
        _check(
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]",
            "top_logprobs",
        )
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop token ids must be >= 0",
            "stop_token_ids",
        )
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed must be in [0, 2^63)", "seed")
        # A finished grammar allows only EOS: ignoring it would run the row past its end.
        _check(
            self.constraint is None or not self.ignore_eos,
            "ignore_eos cannot be combined with a constraint",
            "ignore_eos",
        )
        if self.max_thinking_tokens is not None:
            self._check_thinking_budget(self.max_thinking_tokens)

    def _check_thinking_budget(self, budget: int) -> None:
        param = "max_thinking_tokens"
        _check(budget >= 0, "max_thinking_tokens must be >= 0", param)
        end = self.thinking_end_id
        ok = end is not None and end in self.thinking_close_ids
        _check(ok, "a thinking budget needs the close ids, `</think>` among them", param)
        # A grammar that covered the thinking too would refuse the forced close.
        ok = self.constraint is None or self.constraint.start_after_token_id == end
        _check(ok, "a thinking budget needs the output constraint to start after `</think>`", param)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, decoded and preprocessed by the server. Written by the server.

    patches: [t*h*w, C*T*P*P] float32 pixel patches in the image processor's order
    (models/image_processor.py), what the vision tower's patch embedding reads.
    grid: (t, h, w) in patches. num_tokens: the prompt's image-pad tokens for this image
    (t*h*w / merge^2). digest: a hash of the pixels, which keys the prefix cache (two
    prompts with equal token ids but different images must not share a cached prefix).
    """

    patches: np.ndarray
    grid: tuple[int, int, int]
    num_tokens: int
    digest: str

    def __post_init__(self) -> None:
        t, h, w = self.grid
        _check(min(t, h, w) > 0, "empty image grid", "images")
        _check(self.patches.shape[0] == t * h * w, "patches do not match the grid", "images")
        _check(self.num_tokens > 0, "an image must have tokens", "images")


@dataclass(frozen=True)
class GenerationRequest:
    """One generation the server asks for. `n` > 1 forks the prefilled row n times.

    prefix_hint: a prompt position where later prompts are likely to continue this one
    (a chat's history before the generation prompt: the next turn starts with it); the
    prefix cache snapshots the row's state there too. 0 = none.
    images: the prompt's images in order; image i fills the i-th run of image-pad tokens
    in prompt_ids (images[i].num_tokens of them; the engine checks the counts).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    n: int = 1
    prefix_hint: int = 0
    images: tuple[ImageInput, ...] = ()

    def __post_init__(self) -> None:
        _check(len(self.prompt_ids) > 0, "the prompt is empty", "prompt_ids")
        _check(1 <= self.n <= 16, "n must be in [1, 16]", "n")
        _check(0 <= self.prefix_hint <= len(self.prompt_ids), "bad prefix_hint", "prefix_hint")


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a sampled token and the top alternatives. Written by the engine."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """A delta for one completion (choice `index`) of a request. Written by the engine.

    finish_reason: None while running; "stop" (EOS or stop id), "length" (max_tokens or
    context), "abort" (cancelled) or "error" (then `error` says why).
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far for this choice, including token_ids
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
