"""Test tiers over parameter grids: the quick tier runs a few points of a grid that together take every
value of every axis, the full suite (``pytest --full``) runs the whole product."""

import itertools

import pytest


def grid(*axes: dict) -> list:
    """``pytest.param`` s over the product of ``axes`` (each a dict id -> the tuple of parameter values that
    point fills), ids joined by ``-``. Point ``i`` of the diagonal (every axis at ``i`` modulo its length)
    stays in the quick tier for ``i`` below the longest axis; every other point is marked slow."""
    longest = max(len(a) for a in axes)
    quick = {tuple(i % len(a) for a in axes) for i in range(longest)}
    params = []
    for index in itertools.product(*(range(len(a)) for a in axes)):
        ids, values = [], []
        for axis, i in zip(axes, index):
            key = list(axis)[i]
            ids.append(str(key))
            values.extend(axis[key])
        params.append(pytest.param(*values, id="-".join(ids), marks=() if index in quick else pytest.mark.slow))
    return params
