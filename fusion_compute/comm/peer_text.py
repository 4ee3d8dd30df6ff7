"""Text that came from a peer is data (docs/security.md, "What peers may print"): a farewell's line,
a host a worker claims, a peer's error, a local worker's last words. Before any of it is logged,
printed, raised or shown, every character that is not printable is written as an escape: the C0
controls (ESC, BEL, CR, LF, NUL: a worker could retitle or clear the user's terminal, or forge a
coloured line), DEL and the C1 controls (U+0080..U+009F, which some terminals read as ESC [), the
bidirectional overrides and isolates (U+202A..U+202E, U+2066..U+2069: a line that reads otherwise
than it is), every other format or separator character, and the backslash itself, so an escape in
the output is never ambiguous."""

from __future__ import annotations


def printable(text: str) -> str:
    """`text` with every character that is not printable (str.isprintable: Cc, Cf, Zl, Zp, Zs but the
    space, lone surrogates), and the backslash, written as Python's escape of it (ESC: \\x1b,
    U+202E: \\u202e)."""
    return "".join(c if c.isprintable() and c != "\\" else ascii(c)[1:-1] for c in text)


__all__ = ["printable"]
