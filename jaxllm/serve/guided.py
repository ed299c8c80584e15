"""Structured outputs over HTTP: OpenAI's `response_format` and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`, read into the
engine's `Structured` (`jaxllm.infer.engine.structured`). At most one constraint per request;
an unknown form, an invalid schema, regex or grammar is a 400 naming its field."""

from __future__ import annotations

from jaxllm.infer.engine.structured import Structured, check
from jaxllm.serve.protocol import BadRequest

_VLLM = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}
_VLLM["guided_grammar"] = "grammar"
_NEWER = ("json", "regex", "choice", "grammar")  # structured_outputs' keys


def _response_format(rf: dict) -> dict | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError('json_schema: give {"name": ..., "schema": {...}}')
        return {"json": schema}
    raise ValueError(f"type {kind!r} is not one of 'text', 'json_object', 'json_schema'")


def structured(req) -> Structured | None:
    """The request's constraint (None without one); 400 naming the field at fault."""
    given = []
    if req.response_format not in (None, {"type": "text"}):  # text asks for nothing
        given.append(("response_format", _response_format, req.response_format))
    for field, key in _VLLM.items():
        if getattr(req, field) is not None:
            given.append((field, lambda v, key=key: {key: v}, getattr(req, field)))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", lambda v: v, req.structured_outputs))
    if len(given) > 1:
        names = ", ".join(name for name, _, _ in given)
        raise BadRequest(f"{names}: give at most one structured output constraint", given[1][0])
    if not given:
        return None
    ((field, read, value),) = given
    try:
        spec = read(value)
        if field == "structured_outputs" and (len(spec) != 1 or set(spec) - set(_NEWER)):
            raise ValueError(f"give exactly one of {', '.join(_NEWER)}")
        if spec is None:
            return None
        spec = Structured(**spec)
        check(spec)
    except ValueError as e:
        raise BadRequest(f"{field}: {e}", field) from None
    return spec
