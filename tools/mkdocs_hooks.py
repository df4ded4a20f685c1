"""MkDocs hook (mkdocs.yml, ``hooks:``): the docstrings' Sphinx roles shown as plain code.

The docstrings use Sphinx roles (``:func:`comera.prune_```) in Google-style sections; mkdocstrings renders
them as the role's text followed by the code (``:func:<code>comera.prune_</code>``). This drops the role and,
for ``~a.b.name``, keeps the last component, as Sphinx shows it. Nothing is resolved as a link, so a role
naming a private or moved object cannot fail the strict build.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const|type):<code>(~?)([^<]*)</code>")


def _plain(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def strip_roles(html: str) -> str:
    """``html`` with every rendered Sphinx role reduced to its code."""
    return _ROLE.sub(_plain, html)


def on_page_content(html: str, **kwargs: Any) -> str:
    return strip_roles(html)
