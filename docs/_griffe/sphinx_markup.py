"""A griffe extension for the docs build: the packages' docstrings use Sphinx's inline markup, the site Markdown.

The docstrings are written for ``help()`` and IDEs, with Sphinx roles (``:func:`load_config```) and products
like ``tp*cp*2``. Rendered as Markdown, a role shows its colons and backticks as text and ``*cp*`` turns into
emphasis. This rewrites, at docs-build time only, a role to an inline code span of the name it points at
(``~`` keeps the last component, as Sphinx does) and escapes a ``*`` between two word characters (never
emphasis in reStructuredText either). Code spans and fenced code are left alone.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const):`(~?)([^`]+)`")
CODE = re.compile(r"(```.*?```|``.*?``|`[^`]*`)", flags=re.S)
INNER_STAR = re.compile(r"(?<=\w)\*(?=\w)")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"``{target.rsplit('.', 1)[-1] if tilde else target}``"


def to_markdown(text: str) -> str:
    """Sphinx inline markup of one docstring -> the Markdown the site renders."""
    text = ROLE.sub(_role, text)
    parts = CODE.split(text)  # odd indices are code spans: keep them as written
    return "".join(p if i % 2 else INNER_STAR.sub(r"\\*", p) for i, p in enumerate(parts))


class SphinxMarkup(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`to_markdown`."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
