"""Which scope is current: the frames that decorated calls and ``sharing`` blocks enter."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol


class Timing(Protocol):
    """An audit's clock around one of Ray's calls that send."""

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, Ray's own call, timed."""


class PoolJobs(Protocol):
    def submitted(self) -> None:
        """A job is being submitted to a thread pool: run in the job's context first."""


class SubmitScope(Protocol):
    """What Ray's patched submit path asks of the current scope."""

    def timing(self) -> Timing | None:
        """A clock for the call about to be sent, started now (auditing), or ``None``."""

    def rewrite(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """The task's ``args`` and ``kwargs``, large values replaced by refs."""

    def ray_put(self, value: Any, **options: Any) -> Any:
        """The ref for a ``ray.put(value, **options)`` made in the scope, or ``None`` to
        leave that put to Ray."""

    @property
    def moments(self) -> PoolJobs:
        """What marks the jobs the scope submits to a thread pool."""


class Frame:
    """One entry into a scope (a decorated call, a ``sharing`` block): its scope, or ``None``
    where the entry turned sharing off, and the frame it was entered over.

    Frames are left in any order (a generator holding a block may be closed inside another
    block): a frame left is skipped, never made current again."""

    __slots__ = ("left", "owner", "parent", "scope")

    def __init__(self, scope: SubmitScope | None, parent: Frame | None, owner: object) -> None:
        self.scope = scope
        self.parent = parent
        self.owner = owner
        self.left = False


#: The innermost frame entered in this context; ``None`` outside every scope. asyncio tasks
#: copy it when they are created, and so do tasks submitted to a ``ThreadPoolExecutor`` from
#: inside a scope (see ``refshare._ray.submit``).
_frames: ContextVar[Frame | None] = ContextVar("refshare_frames", default=None)


def current_scope() -> SubmitScope | None:
    """The scope whose ``.remote()`` calls are shared in this context, if any."""
    frame = _frames.get()
    while frame is not None and frame.left:
        frame = frame.parent
    return None if frame is None else frame.scope


def enter(scope: SubmitScope | None, owner: object) -> Frame:
    """Make ``scope`` current in this context, over whatever was (``None``: no sharing)."""
    frame = Frame(scope, _frames.get(), owner)
    _frames.set(frame)
    return frame


def leave(frame: Frame) -> None:
    """Leave ``frame``: the context is back in the innermost frame still open beneath it."""
    frame.left = True
    if _frames.get() is frame:
        parent = frame.parent
        while parent is not None and parent.left:
            parent = parent.parent
        _frames.set(parent)


def innermost(owner: object) -> Frame | None:
    """The innermost open frame in this context that ``owner`` entered."""
    frame = _frames.get()
    while frame is not None and (frame.left or frame.owner is not owner):
        frame = frame.parent
    return frame
