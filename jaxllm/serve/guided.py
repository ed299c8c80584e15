"""Structured outputs over HTTP: OpenAI's `response_format` and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`, read into the
engine's `Structured` (`jaxllm.infer.engine.structured`). At most one constraint per request;
an unknown form, an invalid schema, regex or grammar is a 400 naming its field."""

from __future__ import annotations

from jaxllm.infer.engine.structured import Structured, check
from jaxllm.serve.protocol import BadRequest

_VLLM = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
         "guided_grammar": "grammar"}  # fmt: skip
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


def _fields(field: str, value) -> dict | None:
    """The `Structured` fields one request field asks for (None: nothing)."""
    if field == "response_format":
        return _response_format(value)
    if field == "structured_outputs":
        if len(value) != 1 or set(value) - set(_NEWER):
            raise ValueError(f"give exactly one of {', '.join(_NEWER)}")
        return value
    return {_VLLM[field]: value}


def structured(req) -> Structured | None:
    """The request's constraint (None without one); 400 naming the field at fault."""
    given = [
        (field, getattr(req, field))
        for field in ("response_format", *_VLLM, "structured_outputs")
        if getattr(req, field) is not None
    ]
    given = [(f, v) for f, v in given if (f, v) != ("response_format", {"type": "text"})]
    if len(given) > 1:
        names = ", ".join(field for field, _ in given)
        raise BadRequest(f"{names}: give at most one structured output constraint", given[1][0])
    if not given:
        return None
    ((field, value),) = given
    try:
        fields = _fields(field, value)
        if fields is None:
            return None
        spec = Structured(**fields)
        check(spec)  # a 400 naming the field; the engine checks again against its tokenizer
    except ValueError as e:
        raise BadRequest(f"{field}: {e}", field) from None
    return spec
