"""Constraints (`bitdelta.generation.Constraint`) as llguidance grammars: the one translation the
gateway checks requests with and the worker compiles, so both agree on what is refused.

    grammar = check(Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}'))   # or GenerationError

- JSON (a schema, or any object) is written compactly: no whitespace but the separators ", " and
  ": " (json.dumps' defaults). A grammar that allows any whitespace lets a weak or sampled model
  pad forever (vLLM added `disable-any-whitespace` for that); a fixed layout also makes a schema
  with bounded strings, numbers and arrays bound the whole output.
- A choice is the Lark alternation of its strings (each a JSON string literal, Lark's syntax).
- A grammar is Lark (llguidance's dialect), or GBNF (llama.cpp's and vLLM's, recognised by "::=")
  converted to Lark.
- `Constraint.after`: free text (any valid UTF-8) up to and including it, then the constraint.

`check` is tokenizer-free (the gateway has no model); it runs llguidance's validator, which names
the problem ("Unsatisfiable schema: minLength (5) is greater than maxLength (2)", an unknown rule, a
regex that does not parse, a grammar above `LIMITS`). The worker builds matchers for its own
tokenizer from the same text (services/gpu_worker/constraints.py).
"""

from __future__ import annotations

import functools
import json

import llguidance

from bitdelta.generation import Constraint, ConstraintKind, GenerationError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's defaults but a smaller grammar (500k symbols): a request's grammar is compiled on
# the worker, and one this size takes ~0.2 s there; larger is refused as too large.
MAX_GRAMMAR_SYMBOLS = 200_000


def lark_json(schema: dict) -> str:
    """`schema` as a Lark rule body (llguidance's `%json`), in the same compact layout as JSON_SCHEMA."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, verbose_errors=False)


def grammar_of(c: Constraint) -> str:
    """The llguidance grammar of `c` (a TopLevelGrammar's JSON, or a Lark grammar's text), unchecked;
    with `c.after`, free text up to and including it (llguidance's `stop`), then `c`'s grammar as a
    named sub-grammar."""
    raw = _grammar_of(c)
    if not c.after:
        return raw
    inner = json.loads(raw) if raw.lstrip().startswith("{") else {"grammars": [{"lark_grammar": raw}]}
    first, *rest = inner["grammars"]
    free = f"start: free @bound\nfree[stop={json.dumps(c.after, ensure_ascii=False)}]: /(?s:.*)/"
    return json.dumps({**inner, "grammars": [{"lark_grammar": free}, {**first, "name": "bound"}, *rest]})


def _grammar_of(c: Constraint) -> str:
    M = llguidance.LLMatcher
    if c.kind is ConstraintKind.JSON_SCHEMA:
        return M.grammar_from_json_schema(c.text, overrides=JSON_OPTIONS)
    if c.kind is ConstraintKind.JSON_OBJECT:
        return M.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if c.kind is ConstraintKind.REGEX:
        return M.grammar_from_regex(c.text)
    if c.kind is ConstraintKind.CHOICE:
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(s, ensure_ascii=False) for s in c.choices))
    text = c.text
    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter raises plain exceptions on what it cannot read
            raise GenerationError("sampling.constraint", f"the GBNF grammar does not parse: {e}") from None
    return M.grammar_from_lark(text)


@functools.lru_cache(maxsize=256)
def check(c: Constraint) -> str:
    """`c`'s grammar, or GenerationError naming what is wrong with it (malformed, unsatisfiable, too
    large). Cached per constraint; may take up to ~0.2 s for the largest grammars: call it off the
    event loop."""
    c.validate()
    try:
        grammar = grammar_of(c)
    except ValueError as e:
        raise GenerationError("sampling.constraint", f"the {c.kind.value} is not valid: {e}") from None
    problem = llguidance.LLMatcher.validate_grammar(grammar, limits=limits())
    if problem:
        raise GenerationError("sampling.constraint", f"the {c.kind.value} cannot be used: {problem.strip()[:500]}")
    return grammar
