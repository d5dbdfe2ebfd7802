"""Bounds a grammar must meet before llguidance sees it: cheap, deterministic checks of its size, nesting, rule
chains, repetitions and choices, each refused with an InvalidRequestError that names the limit.

llguidance compiles rule chains by recursion on its thread's stack: a JSON schema whose `$ref` chain is 1,000
definitions deep, or a Lark grammar of 5,000 chained rules, overflows it and kills the process (SIGSEGV, no
Python exception). Counted repetitions multiply its lexer's work: `a{1000000}` compiles, then fails on its first
token ("too many expressions constructed"), and `(X{1000}){1000}` holds ~170 MB. The limits sit far below where
llguidance breaks and far above what real schemas and grammars use; grammar_worker.py is the backstop for the rest.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pagedllm.errors import InvalidRequestError

MAX_GRAMMAR_BYTES = 1 << 20  # the grammar's text (a schema, regex, choice list or Lark/GBNF grammar), UTF-8
MAX_SCHEMA_DEPTH = 128  # objects and arrays along any path through a JSON schema, `$ref` hops included
MAX_RULE_DEPTH = 200  # rules along any chain of references in a Lark / GBNF grammar
MAX_RULES = 5_000  # rules in a Lark / GBNF grammar
MAX_REPEAT = 5_000  # nested counted repetitions ({n}, {m,n}) multiplied: a mask row of a{5000} ~1.4 ms, a{10000} ~15
MAX_CHOICES = 10_000  # entries of a `choice` list (100,000 compiled for 135 s; 10,000 in 0.2 s)
# What one request's grammar masks may cost each step (CPU time, all its samples' rows summed), averaged over its last
# MASK_BUDGET_STEPS steps: over it the request fails. a{5000} costs ~1.1 ms a row, so n=32 of it ~35 ms a step.
MAX_MASK_MS_PER_STEP = 10.0
MASK_BUDGET_STEPS = 8


def check_mask_cost(row_seconds: float, n: int) -> None:
    """n samples of a grammar whose mask costs `row_seconds` a row (measured in its start state) within the mask
    budget; the budget itself is enforced step by step (structured_output.MaskBudget), this refuses the plain cases
    before a step is spent."""
    step_ms = n * row_seconds * 1e3
    if step_ms > MAX_MASK_MS_PER_STEP:
        raise InvalidRequestError(
            f"the grammar's token mask costs {row_seconds * 1e3:.2f} ms of CPU per sample: {n} samples would cost "
            f"{step_ms:.1f} ms every step, over the limit of {MAX_MASK_MS_PER_STEP:g} ms; a simpler grammar or "
            "fewer samples (n) fit")


def check_size(text: str, what: str) -> None:
    """At most MAX_GRAMMAR_BYTES of valid Unicode (JSON can carry half a UTF-16 pair, "\\ud800"; llguidance
    cannot take one)."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequestError(f"the {what} is not valid Unicode (a lone UTF-16 surrogate)") from None
    if size > MAX_GRAMMAR_BYTES:
        raise InvalidRequestError(f"the {what} is {size:,} bytes, over the limit of {MAX_GRAMMAR_BYTES:,} bytes")


def load_schema_text(text: str) -> Any:
    """A JSON schema given as text, parsed; deeper than Python's parser goes is a limit error, not a crash."""
    check_size(text, "JSON schema")
    if max_bracket_depth(text) > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"the JSON schema nests objects and arrays deeper than the limit of "
                                  f"{MAX_SCHEMA_DEPTH} levels")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from None


def max_bracket_depth(text: str) -> int:
    """How deep `[` and `{` nest in JSON text, outside strings (a linear scan, no recursion)."""
    depth = deepest = 0
    for token in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        char = token.group()
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


# ---- JSON schemas ------------------------------------------------------------------------------------------
def check_schema(schema: Any) -> None:
    """A schema's nesting (objects and arrays along any path, `$ref` hops followed), size and the repetitions of
    its `pattern`s within the limits."""
    longest_path([schema], lambda node: _schema_children(schema, node), MAX_SCHEMA_DEPTH,
                 f"the JSON schema nests deeper than the limit of {MAX_SCHEMA_DEPTH} levels (objects, arrays and "
                 "$ref hops along one path)")
    check_size(json.dumps(schema, ensure_ascii=False), "JSON schema")
    for pattern in _patterns(schema):
        check_repeats(pattern, "a pattern of the JSON schema")


def _schema_children(root: Any, node: Any) -> Iterator[Any]:
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    yield from (v for v in values if isinstance(v, (dict, list)))
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        target = _resolve(root, node["$ref"])
        if target is not None:
            yield target


def _resolve(root: Any, ref: str) -> Any:
    """The local target of a `$ref` ("#/$defs/x"), or None (remote or missing: llguidance refuses those)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, list)) else None


def _patterns(schema: Any) -> Iterator[str]:
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                yield node["pattern"]
            if isinstance(node.get("patternProperties"), dict):
                yield from node["patternProperties"]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def longest_path(roots: Iterable[Any], children: Callable[[Any], Iterable[Any]], limit: int, message: str) -> None:
    """Raise InvalidRequestError(message) if a path from any of `roots` has more than `limit` nodes (a reference
    back to a node on the path ends it: a cycle is recursion, which llguidance handles). Iterative, and each node's
    depth is computed once, so neither long chains nor diamonds cost more than the graph's size."""
    memo: dict[int, int] = {}  # id(node) -> nodes on the longest path from it
    for root in roots:
        if id(root) in memo:
            continue
        on_path = {id(root)}
        stack: list[tuple[Any, Iterator[Any]]] = [(root, iter(children(root)))]
        while stack:
            node, pending = stack[-1]
            child = next(pending, None)
            if child is None:
                stack.pop()
                on_path.discard(id(node))
                memo[id(node)] = 1 + max((memo.get(id(c), 0) for c in children(node) if id(c) not in on_path),
                                         default=0)
                if memo[id(node)] + len(stack) > limit:
                    raise InvalidRequestError(message)
            elif id(child) not in memo and id(child) not in on_path:
                if len(stack) >= limit:
                    raise InvalidRequestError(message)
                on_path.add(id(child))
                stack.append((child, iter(children(child))))


# ---- regexes -------------------------------------------------------------------------------------------------
_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_BRACED_ESCAPE = re.compile(r"\\[pPxu]\{[^}]*\}")


def repeat_product(regex: str) -> int:
    """The largest product of nested counted repetitions: 1,000,000 for `(X{1000}){1000}` and for `a{1000000}`
    ({m,} counts m: an open end is a loop, not a copy). A single pass; anything that is not a group, class or
    quantifier counts as an atom, so the figure is an upper bound for odd inputs, never a parse error."""
    frames = [[1, 1]]  # per open group: [largest product inside, product of the last atom]
    i, n = 0, len(regex)
    while i < n:
        char = regex[i]
        quantifier = _QUANTIFIER.match(regex, i) if char == "{" else None
        if char == "\\":
            escape = _BRACED_ESCAPE.match(regex, i)
            i = escape.end() if escape else i + 2
            frames[-1][1] = 1
            continue
        if char == "[":
            i = _class_end(regex, i)
            frames[-1][1] = 1
            continue
        if char == "(":
            frames.append([1, 1])
        elif char == ")" and len(frames) > 1:
            inner = frames.pop()[0]
            frames[-1][1] = inner
        elif quantifier:
            frames[-1][1] *= max(int(quantifier.group(2) or quantifier.group(1)), 1)
            i = quantifier.end() - 1
        elif char not in "*+?|":
            frames[-1][1] = 1
        frames[-1][0] = max(frames[-1][0], frames[-1][1])
        i += 1
    while len(frames) > 1:
        inner = frames.pop()[0]
        frames[-1][0] = max(frames[-1][0], inner)
    return frames[0][0]


def _class_end(regex: str, start: int) -> int:
    """The index after the `]` that closes the class opened at `start` (escapes and a leading `]` or `^]` kept)."""
    i = start + 1
    if i < len(regex) and regex[i] == "^":
        i += 1
    if i < len(regex) and regex[i] == "]":
        i += 1
    while i < len(regex) and regex[i] != "]":
        i += 2 if regex[i] == "\\" else 1
    return i + 1


def check_repeats(regex: str, what: str) -> None:
    product = repeat_product(regex)
    if product > MAX_REPEAT:
        raise InvalidRequestError(f"{what} repeats {product:,} times (nested counts {{n}} multiplied), over the "
                                  f"limit of {MAX_REPEAT:,}")


# ---- Lark / GBNF grammars -----------------------------------------------------------------------------------
_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?[ \t]*:(?![:=])", re.M)
_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/[imsxlu]*|#[^\n]*|//[^\n]*')
_JSON_RULE = re.compile(r"%json\s*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_lark(lark: str) -> None:
    """Rule count, the longest chain of rule references, and counted repetitions of a Lark grammar (GBNF converted
    to Lark first) within the limits."""
    check_repeats(lark, "the grammar")
    for schema in _json_bodies(lark):  # `%json {...}`: a schema inside the grammar (forced tool calls use them)
        check_schema(schema)
    bare = _LITERALS.sub(" ", lark)
    starts = list(_RULE.finditer(bare))
    if len(starts) > MAX_RULES:
        raise InvalidRequestError(f"the grammar has {len(starts):,} rules, over the limit of {MAX_RULES:,}")
    bodies = {m.group(1): bare[m.end():nxt.start() if nxt else len(bare)]
              for m, nxt in zip(starts, [*starts[1:], None])}
    refs = {name: sorted({r for r in _NAME.findall(body) if r in bodies and r != name})
            for name, body in bodies.items()}
    nodes = {name: _Rule(name) for name in refs}
    message = f"the grammar chains rules deeper than the limit of {MAX_RULE_DEPTH} (a rule that uses a rule ...)"
    longest_path(nodes.values(), lambda rule: (nodes[r] for r in refs[rule.name]), MAX_RULE_DEPTH, message)


def _json_bodies(lark: str) -> Iterator[Any]:
    decoder = json.JSONDecoder()
    for match in _JSON_RULE.finditer(lark):
        try:
            yield decoder.raw_decode(lark, match.end())[0]
        except (ValueError, RecursionError):
            continue  # llguidance refuses it (its parser stops at 128 levels)


class _Rule:
    """A node of the rule graph (longest_path tells nodes apart by identity)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name
