"""Megatron-Core module specs changed in place of being rebuilt: a spec's submodules, whether megatron-core gives
it as a ModuleSpec or (0.17 and later, for a dense MLP) as a functools.partial."""

from __future__ import annotations

import dataclasses
import functools


def spec_submodules(spec):
    """A submodule spec's submodules: a ModuleSpec's, or those bound into the functools.partial that megatron-core
    0.17 and later give a dense MLP (`partial(MLP.as_mlp_submodule, submodules=...)`)."""
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    return spec.submodules


def replace_spec_submodules(spec, **changes):
    """`spec` (a ModuleSpec or such a partial) with some of its submodules replaced."""
    submodules = dataclasses.replace(spec_submodules(spec), **changes)
    if isinstance(spec, functools.partial):
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
    return dataclasses.replace(spec, submodules=submodules)
