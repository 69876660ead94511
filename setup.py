"""The package's description: the README, its relative links made absolute.

Everything else is declared in setup.cfg. On the package index the README stands alone, with
no ``docs/`` beside it, so each relative link points into the repository that ``Source`` in
setup.cfg names (an image to its raw file).
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
BRANCH = "main"
#: ``[text](target)`` and ``![alt](target)``.
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
#: A target that is already absolute: a scheme, an anchor, a path from the root.
ABSOLUTE = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*:|#|/")


def source_url() -> str:
    config = configparser.ConfigParser()
    config.read(HERE / "setup.cfg", encoding="utf-8")
    lines = config["metadata"]["project_urls"].strip().splitlines()
    urls = {name.strip(): url.strip() for name, _, url in (x.partition("=") for x in lines)}
    return urls["Source"].rstrip("/")


def absolute_links(text: str, source: str) -> str:
    def absolute(match: re.Match[str]) -> str:
        image, label, target = match.groups()
        if ABSOLUTE.match(target):
            return match.group(0)
        kind = "raw" if image else "blob"
        return f"{image}[{label}]({source}/{kind}/{BRANCH}/{target})"

    return LINK.sub(absolute, text)


setup(long_description=absolute_links((HERE / "README.md").read_text("utf-8"), source_url()))
