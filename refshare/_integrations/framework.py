"""What refshare knows of one framework: its release, and the methods that fan out."""

from __future__ import annotations

from typing import NamedTuple


class Target(NamedTuple):
    """Methods of one class (or functions of one module, when ``owner`` is empty)."""

    module: str
    owner: str
    methods: tuple[str, ...]


class Framework(NamedTuple):
    """A framework ``enable`` knows: the release its layout was read from, and its layouts.

    Where a framework moved its code, each layout is one alternative; the first whose
    modules import is the one wrapped."""

    name: str
    release: str
    layouts: tuple[tuple[Target, ...], ...]
