"""Tool declarations and parameter values: the declared tools by name, and raw parameter text made into JSON.

The schemas are the client's JSON, any shape: a member of the wrong type is
ignored, never an error. Only the XML, Gemma and Python call formats convert
values with them; the JSON formats keep the model's JSON as written.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from lucebox.errors import LuceboxError


def normalize_tools(tools: list[dict]) -> dict[str, dict]:
    """Map tool name -> JSON schema of its parameters.

    Accepts `{"name", "description", "parameters"}` and the OpenAI wrapper
    `{"type": "function", "function": {...}}`.
    """
    out: dict[str, dict] = {}
    for n, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise LuceboxError(f"tools[{n}] must be an object")
        if isinstance(tool.get("function"), dict):
            tool = tool["function"]
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise LuceboxError(f"tools[{n}] has no name")
        params = tool.get("parameters")
        out[name] = params if isinstance(params, dict) else {}
    return out


_SCHEMA_DEPTH = 32
"""anyOf/oneOf nesting followed when reading a schema's types; deeper alternatives count as unknown."""


def schema_types(schema: Any, depth: int = 0) -> set[str]:
    """The JSON types a schema admits (type, type lists, anyOf/oneOf, enum); empty if unknown.

    The schema is the client's JSON, any shape: members of the wrong type are ignored, never an error.
    """
    if not isinstance(schema, dict) or depth > _SCHEMA_DEPTH:
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else []:
            types |= schema_types(sub, depth + 1)
    if not types and isinstance(schema.get("enum"), list):
        for v in schema["enum"]:
            types.add("string" if isinstance(v, str) else "boolean" if isinstance(v, bool)
                      else "integer" if isinstance(v, int) else "number" if isinstance(v, float)
                      else "null" if v is None else "object")
    return types


def param_schema(params: dict, key: str) -> dict | None:
    props = params.get("properties")
    if isinstance(props, dict) and isinstance(props.get(key), dict):
        return props[key]
    return None


def is_plain_string(schema: dict | None) -> bool:
    return schema_types(schema) == {"string"}


def best_effort(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested past what the parser follows: keep the text
        return raw


def convert_param(raw: str, schema: dict | None) -> Any:
    """Turn a parameter's raw text into a JSON value the tool's schema expects.

    A string parameter keeps the raw text; integer, number, boolean and null are
    parsed; object/array are parsed as JSON (Python literals accepted); a value
    that does not fit, or a parameter the schema does not declare, is parsed as
    JSON when it is JSON and kept as text otherwise.
    """
    types = schema_types(schema)
    if not types:
        return best_effort(raw)
    s = raw.strip()
    if "null" in types and s in ("null", "None"):
        return None
    if "string" in types:
        return raw
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if "integer" in types and re.fullmatch(r"[+-]?\d+", s):
        return int(s)
    if "number" in types or "integer" in types:
        try:
            v = float(s)
        except ValueError:
            v = None
        if v is not None and math.isfinite(v):
            return int(v) if v.is_integer() and re.fullmatch(r"[+-]?\d+(\.0*)?", s) else v
    if "object" in types or "array" in types:
        for parse in (json.loads, ast.literal_eval):
            try:
                v = parse(s)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if isinstance(v, (dict, list)):
                return v
    return best_effort(raw)

