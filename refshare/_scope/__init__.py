"""One call's sharing: how each argument travels (``scope``), what the call stored and keeps
alive (``store``), and what it worked out about its values (``memo``)."""

from .scope import Scope as Scope
