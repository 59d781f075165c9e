"""Shared pieces of the grammar tests (test_grammar.py, test_tool_grammar.py,
test_constrained.py): the schema and tool corpora with their validators (tests/data/README.md
says where they come from), the module-scoped `compiler` fixture on the real Qwen3.5
vocabulary, and random walks through a grammar's masks.

Not a test module: test files import what they use (tests/ is on sys.path), the fixture as
`compiler_fixture`, which pytest registers under the name `compiler`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import regex

from deltaserve.engine.structured.grammar import GrammarCompiler, grammar_compiler
from deltaserve.engine.structured.matchers import RowConstraints
from deltaserve.engine.structured.spec import Constraint
from deltaserve.engine.structured.token_mask import allowed_ids
from deltaserve.engine.types import SamplingParams
from deltaserve.models.testing import cached_checkpoint
from deltaserve.models.testing.tokenizer import EOS_TOKEN_IDS

DATA = Path(__file__).parent / "data"
VOCAB = 248320  # the test checkpoints' logits width (Qwen3.5's padded vocabulary)
# Schemas of the suite the engine refuses, and the words its error must name.
REFUSED = {
    "additionalProperties with propertyNames": "propertyNames",
    "dependentSchemas with additionalProperties": "dependentSchemas",
    "maxLength validation with a decimal": "maxLength",
    "minLength validation with a decimal": "minLength",
    "allOf with boolean schemas, some false": "Unsatisfiable",
    "allOf with boolean schemas, all false": "Unsatisfiable",
    "minProperties validation with a decimal": "minProperties",
}


# -- corpus helpers -------------------------------------------------------------------------
def _pattern(validator: Any, pattern: str, instance: Any, schema: dict) -> Any:
    # ECMA-262 patterns such as \p{Letter} need `regex`; Python's re rejects them.
    if isinstance(instance, str) and not regex.search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _pattern})


def validate(instance: Any, schema: Any) -> None:
    """jsonschema's draft 2020-12 validation, with ECMA-style patterns."""
    _Validator(schema).validate(instance)


def load_schemas() -> list[dict[str, Any]]:
    """The JSON-Schema-Test-Suite draft 2020-12 entries: {file, description, schema}."""
    return json.loads((DATA / "json_schema_suite.json").read_text(encoding="utf-8"))


def load_tools() -> list[dict[str, Any]]:
    """The BFCL functions as OpenAI tools, BFCL's own type names mapped to JSON Schema's
    (dict -> object, float -> number, as BFCL's OpenAI handler does)."""
    functions = json.loads((DATA / "bfcl_exec_simple_functions.json").read_text())
    renamed = json.loads(json.dumps(functions).replace('"dict"', '"object"'))
    renamed = json.loads(json.dumps(renamed).replace('"float"', '"number"'))
    return [{"type": "function", "function": f} for f in renamed]


def is_bounded(schema: Any, root: Any = None) -> bool:
    """Whether every document of `schema` has bounded strings (keys included), so a model
    sampling at random must close them: enums, consts, maxLength strings, numbers,
    booleans, null, and arrays / closed objects of those."""
    root = schema if root is None else root
    if not isinstance(schema, dict):
        return schema is False
    if "enum" in schema or "const" in schema:
        return True
    if "$ref" in schema:
        name = schema["$ref"].split("/")[-1]
        return is_bounded(root.get("$defs", {}).get(name, {}), root)
    if any(is_bounded(b, root) for b in schema.get("allOf", [])):
        return True
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return all(is_bounded(b, root) for b in schema[key])
    types = schema.get("type")
    if types is None:
        return False  # any JSON value: strings and free object keys included
    types = [types] if isinstance(types, str) else types
    return all(_type_bounded(t, schema, root) for t in types)


def _type_bounded(kind: str, schema: dict, root: Any) -> bool:
    if kind == "string":
        return "maxLength" in schema
    if kind == "array":
        prefix = all(is_bounded(s, root) for s in schema.get("prefixItems", []))
        return prefix and is_bounded(schema.get("items", True), root)
    if kind == "object":
        closed = schema.get("additionalProperties", True) is False
        props = schema.get("properties", {}).values()
        return closed and all(is_bounded(p, root) for p in props)
    return True


def _bounded_strings(tools: list[dict]) -> list[dict]:
    """The tools with a maxLength on their string parameters (random text rarely closes)."""
    out = json.loads(json.dumps(tools))
    for tool in out:
        for schema in tool["function"]["parameters"]["properties"].values():
            if schema.get("type") == "string":
                schema["maxLength"] = 12
    return out


# -- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module", name="compiler")
def compiler_fixture() -> GrammarCompiler:
    """The tiny checkpoint's grammar compiler (test modules import it as compiler_fixture)."""
    path = cached_checkpoint("tiny")
    return grammar_compiler(path, VOCAB, tuple(EOS_TOKEN_IDS), 5.0)


def _walk(compiler: GrammarCompiler, constraint: Constraint, seed: int, steps: int = 80):
    """Random allowed tokens until the grammar ends: (token ids, whether it ended)."""
    rows = RowConstraints(compiler, VOCAB, EOS_TOKEN_IDS)
    rows.add(["w/0"], rows.compile(constraint), SamplingParams(constraint=constraint))
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    for _ in range(steps):
        mask = rows.masks(["w/0"])
        assert mask is not None
        ids = allowed_ids(mask.bits[0], VOCAB)
        token = int(rng.choice(ids))
        if token in EOS_TOKEN_IDS:
            return tokens, True
        tokens.append(token)
        rows.accept(["w/0"], [token])
    return tokens, False


def _decode(compiler: GrammarCompiler, tokens: list[int]) -> str:
    return compiler.tokenizer.decode_str(tokens)
