"""Parametrisation of the default suite: a covering subset of a grid runs by default, the
rest of the grid under the `slow` marker (`pytest -m slow`)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import pytest


def slow_unless(cases: Iterable, default: Collection) -> list:
    """`cases` for `pytest.mark.parametrize`, those not in `default` marked slow. A tuple
    case is one value per argument name."""
    return [
        case
        if case in default
        else pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow)
        for case in cases
    ]


def selected_values(request: pytest.FixtureRequest, argname: str) -> list:
    """The values of `argname` in the tests of the requesting module that this session
    runs, for a module fixture that computes every case in one subprocess."""
    values = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and argname in params:
            values.add(params[argname])
    return sorted(values)
