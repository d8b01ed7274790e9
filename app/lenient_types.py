"""Request value types that read what vLLM reads (its pydantic models are lax) and say so in
/openapi.json: an integer field also takes an integral float (`4.0`) or a string of digits
(`"4"`), a number field a numeric string, a boolean field `0`/`1` or `"true"`/`"false"`.
Anything else is refused exactly as a strict field refuses it, and the schema's patterns are
the very expressions the conversion uses, so the document and the server agree."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

INT_PATTERN = r"[+-]?[0-9]+"
FLOAT_PATTERN = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_BOOL_STRINGS = {"true": True, "false": False}

IntString = Annotated[str, Field(pattern=f"^{INT_PATTERN}$")]
FloatString = Annotated[str, Field(pattern=f"^{FLOAT_PATTERN}$")]
BoolString = Annotated[str, Field(pattern="^(true|false)$")]


def _to_int(value: Any) -> Any:
    if isinstance(value, str) and re.fullmatch(INT_PATTERN, value):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def int_as_read(value: Any) -> int | None:
    """The integer a lenient int field reads from a raw JSON value (`4`, `4.0`, `"4"`),
    bounds not applied; None where it reads none (the field then refuses the value). For
    checks made on the decoded body before the schema: they see what the request will use."""
    try:
        value = _to_int(value)
    except ValueError:  # a string of more digits than int() converts: refused as well
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _to_float(value: Any) -> Any:
    if isinstance(value, str) and re.fullmatch(FLOAT_PATTERN, value):
        return float(value)
    return value


def _to_bool(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value in _BOOL_STRINGS:
        return _BOOL_STRINGS[value]
    return value


def lenient_int(**constraints: Any) -> Any:
    """An int field (with Field constraints such as ge/le) read leniently."""
    checked = Annotated[int, Field(**constraints)]
    return Annotated[checked, BeforeValidator(_to_int, json_schema_input_type=checked | IntString)]


def lenient_float(**constraints: Any) -> Any:
    checked = Annotated[float, Field(**constraints)]
    return Annotated[
        checked, BeforeValidator(_to_float, json_schema_input_type=checked | FloatString)
    ]


LenientBool = Annotated[
    bool,
    BeforeValidator(
        _to_bool, json_schema_input_type=bool | Annotated[int, Field(ge=0, le=1)] | BoolString
    ),
]
