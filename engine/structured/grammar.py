"""Compiling a Constraint into a grammar matcher on the model's vocabulary (llguidance).

Why llguidance and not xgrammar: `python -m bench.constrained engines`, both on Qwen3.5's
tokenizer (248,320 logits), 2-core x86, the 84 schemas of tests/data (2026-11-30):

                          llguidance 1.9.1         xgrammar 0.2.9
    tokenizer set-up      4.4 s                    5.0 s
    compile per schema    0.8 ms mean, 2.8 max     43.7 ms mean, 420 max
    compiled / refused    77 / 7, each by name     79 / 5; compiles `not`, propertyNames
                                                   and dependentSchemas, ignoring them
    mask per token        p50 129 us, p99 435      p50 195 us, p99 310
    32 rows' masks        p50 1.2 ms (executor)    p50 2.0 ms (batch matcher)

A new schema is compiled on every request that brings one, so xgrammar's precomputed
masks cost ~50x more up front; a keyword it ignores would break "valid against the
schema" without a word, where llguidance refuses by name. Both write the same packed
bitmask. llguidance also takes Lark grammars with inline JSON schemas (the tool-call
grammar) and regexes, and loads its tokenizer straight from tokenizer.json.

One GrammarCompiler per model directory, shared by threads: the engine registers it
(grammar_compiler), the server finds it (find_compiler) and compiles in its thread pool,
so errors become a 400 before the engine sees the request and the engine thread finds
the result in the cache. A compile past `timeout_s` is refused; llguidance cannot be
interrupted, so it finishes on its worker thread (it releases the GIL) and is dropped.
The tokenizer (~4 s for 248k tokens) loads on first use or at warm_up().
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import llguidance as llg

from deltaserve.engine.errors import InvalidRequestError
from deltaserve.engine.structured.spec import PARAM, Constraint
from deltaserve.engine.structured.tool_grammar import tool_call_lark
from deltaserve.models.chat_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
_CACHE_SIZE = 256
# Compact JSON with the separators json.dumps uses: fixed whitespace keeps a sampled
# document from growing runs of blanks, and unimplemented keywords are errors (lenient).
_JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: `matcher` is a template in its start state; rows run
    deep copies of it and never advance the template itself."""

    matcher: llg.LLMatcher
    grammar: str  # llguidance's serialized grammar (for logs and tests)


class GrammarCompiler:
    """Compiles Constraints for one tokenizer; thread-safe, with an LRU of results."""

    def __init__(
        self,
        tokenizer_file: Path,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """vocab_size: the width of the model's logits (masks have one bit per id)."""
        self.tokenizer_file = Path(tokenizer_file)
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.timeout_s = timeout_s
        # Workers: a compile past its time limit keeps one until it finishes.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="grammar")
        self._tokenizer: Future[llg.LLTokenizer] | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def warm_up(self) -> None:
        """Start loading the tokenizer in the background (idempotent)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(self._load_tokenizer)

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        """The llguidance tokenizer; raises InvalidRequestError if it cannot load."""
        self.warm_up()
        assert self._tokenizer is not None
        try:
            return self._tokenizer.result()
        except OSError as exc:
            raise InvalidRequestError(
                f"constrained decoding is unavailable: {exc}", PARAM
            ) from None

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of `constraint`; raises InvalidRequestError naming the
        problem (bad schema, unsupported keyword, over the time limit)."""
        key = constraint.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        self.tokenizer  # noqa: B018 - the one-off load is not part of the time limit
        future = self._pool.submit(self._build, constraint)
        try:
            compiled = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise InvalidRequestError(
                f"the {constraint.kind} constraint did not compile within {self.timeout_s:g} s",
                PARAM,
            ) from None
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _load_tokenizer(self) -> llg.LLTokenizer:
        text = self.tokenizer_file.read_text(encoding="utf-8")
        return llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=list(self.eos_ids))

    def _build(self, constraint: Constraint) -> CompiledGrammar:
        grammar = self._grammar(constraint)
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{constraint.kind}: {matcher.get_error()}", PARAM)
        for warning in matcher.get_grammar_warnings():
            log.warning("grammar warning (%s): %s", constraint.kind, warning)
        return CompiledGrammar(matcher, grammar)

    def _grammar(self, constraint: Constraint) -> str:
        kind = constraint.kind
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(constraint.grammar)
        if kind == "lark":
            return llg.LLMatcher.grammar_from_lark(constraint.grammar)
        schema = {"type": "object"} if kind == "json_object" else constraint.schema
        # strict never approximates; otherwise oneOf may be read as anyOf.
        options = {**_JSON_OPTIONS, "coerce_one_of": not constraint.strict}
        if constraint.tools:  # tool calls, or (JSON kinds) the document instead
            document = None if kind == "tool_calls" else _inline_json(schema, options)
            call_open, call_close = self._tag(TOOL_CALL_OPEN), self._tag(TOOL_CALL_CLOSE)
            lark = tool_call_lark(
                constraint.tools, call_open, call_close, constraint.parallel_calls, document
            )
            return llg.LLMatcher.grammar_from_lark(lark)
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as exc:
            raise InvalidRequestError(f"{kind}: {exc}", PARAM) from None

    def _tag(self, text: str) -> str:
        """A markup tag for a Lark grammar: its token when the tokenizer has it as one
        special token (as Qwen3.5's chat template writes it), else the literal text."""
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)


def _inline_json(schema: object, options: dict) -> str:
    """A Lark `%json` expansion of a schema; the options ride in its x-guidance key."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}  # false: refused by the compiler, by name
    _json = dict(schema)  # type: ignore[arg-type]
    _json["x-guidance"] = {**_json.get("x-guidance", {}), **options}
    return "%json " + json.dumps(_json, ensure_ascii=False)


_REGISTRY: dict[Path, GrammarCompiler] = {}
_REGISTRY_LOCK = threading.Lock()


def grammar_compiler(
    model_dir: Path, vocab_size: int, eos_ids: tuple[int, ...], timeout_s: float
) -> GrammarCompiler:
    """The process's compiler for a model directory (its tokenizer.json), created on first
    call (cheap: nothing loads yet) and registered for find_compiler."""
    key = Path(model_dir).resolve()
    with _REGISTRY_LOCK:
        compiler = _REGISTRY.get(key)
        same = compiler is not None and (compiler.vocab_size, compiler.eos_ids) == (
            vocab_size,
            tuple(eos_ids),
        )
        if not same:
            compiler = GrammarCompiler(key / "tokenizer.json", vocab_size, eos_ids, timeout_s)
            _REGISTRY[key] = compiler
        return compiler


def find_compiler(model_dir: Path) -> GrammarCompiler | None:
    """The compiler an engine in this process registered for `model_dir`, if any."""
    with _REGISTRY_LOCK:
        return _REGISTRY.get(Path(model_dir).resolve())
