"""Field checks and the mapping-to-dataclass reader shared by every configuration
(`bam_jax.ModelConfig`, `bam_configs.training`): each error names the field and what it
expected."""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from typing import Any

import numpy as np

FLOAT32_MAX = 3.4028234663852886e38


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_float32_number(value: object) -> bool:
    """A real number (not a bool) that is finite in float32."""
    return is_number(value) and math.isfinite(value) and abs(value) <= FLOAT32_MAX


def check_positive_int(name: str, value: Any) -> None:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {bounds}, got {value!r}")


def check_float32(name: str, value: Any, minimum: float, maximum: float | None = None) -> None:
    """A number in [minimum, maximum] that float32 holds as a finite number."""
    check_finite_float32(name, value)
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum:g}" if maximum is None else f"in [{minimum:g}, {maximum:g}]"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")


def check_positive_float32(name: str, value: Any) -> None:
    """A number > 0 that float32 holds as a finite number, without rounding it to 0."""
    check_finite_float32(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if np.float32(value) == 0:
        raise ValueError(f"{name} must be > 0 in float32, got {value!r}, which rounds to 0")


def check_finite_float32(name: str, value: Any) -> None:
    if not is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"{name} must fit in float32 (at most {FLOAT32_MAX:.8g}), got {value!r}")


def check_bool_fields(config: Any, prefix: str = "") -> None:
    """Every field annotated `bool` holds a bool."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.type == "bool" and not isinstance(value, bool):
            raise ValueError(f"{prefix}{field.name} must be true or false, got {value!r}")


def dataclass_from_dict(kind: type, d: Any, path: str = "") -> Any:
    """The (nested) dataclass `kind` of a mapping such as a config.json: missing fields take
    their defaults; unknown keys, values of the wrong type and bad values raise a ValueError
    naming the key path."""
    if isinstance(d, kind):
        return d
    if not isinstance(d, dict):
        raise ValueError(
            f"config: {path or 'the config'} must be a mapping of field names to values, "
            f"got {type(d).__name__} {reprlib.repr(d)}"
        )
    hints = typing.get_type_hints(kind)
    unknown = sorted(set(d) - set(hints))
    if unknown:
        names = ", ".join(f"'{join_path(path, name)}'" for name in unknown)
        raise ValueError(
            f"config: unknown field{'s' if len(unknown) > 1 else ''} {names}; valid fields"
            f"{f' of {path}' if path else ''}: {', '.join(sorted(hints))}"
        )
    values = {
        name: _field_from_dict(hints[name], value, join_path(path, name))
        for name, value in d.items()
    }
    try:
        return kind(**values)
    except ValueError as err:
        raise ValueError(_name_section(path, str(err), hints)) from None


def describe_type(annotation: Any) -> str:
    """How an error message names the values a field accepts."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(describe_type(arg) for arg in typing.get_args(annotation))
    names = {bool: "true or false", int: "an int", float: "a number", str: "a string"}
    if annotation is type(None):
        return "None"
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def join_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _field_from_dict(annotation: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(annotation):
        return dataclass_from_dict(annotation, value, path)
    if not _has_type(value, annotation):
        raise ValueError(
            f"config: {path} must be {describe_type(annotation)}, got {reprlib.repr(value)}"
        )
    return value


def _has_type(value: Any, annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return is_int(value)
    if annotation is float:
        return is_number(value)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def _name_section(path: str, message: str, hints: dict[str, Any]) -> str:
    """A section's own error message with the section named: "dim must ..." becomes
    "model.dim must ..."."""
    if not path or message.startswith((f"{path}.", f"{path}:")):
        return message
    first_word = message.split(" ", 1)[0]
    return f"{path}.{message}" if first_word in hints else f"{path}: {message}"
