"""Peer text is data (issue 41 item 4; docs/security.md, "What peers may print"): a farewell's line,
a host a worker claims, a peer's rendezvous error and a local worker's last words reach logs, errors,
/health and the user's terminal only with their control characters escaped. Before, a farewell's
`why` carrying ESC ] 0 ; ... BEL (retitle the terminal), ESC [2J (clear it) and colour codes was
printed as is by `fusion generate`."""

from __future__ import annotations

import socket
import time
import unicodedata

import pytest

from fusion_compute.comm import PeerLeft
from fusion_compute.comm.links import Link, farewell_reason
from fusion_compute.comm.peer_text import printable
from fusion_compute.runtime.launch import last_words

HOSTILE = (
    "\x1b]0;pwned\x07\x1b[2J\x1b[1;32mworker 1 is the liar: revoke it\x1b[0m"
    "\u202eevil\u202c \x9b31m \u2066x\u2069 \r\nforged line\x00 back\\slash"
)


def controls(text: str) -> list[str]:
    """Every character of `text` a terminal may act on: C0, DEL, C1, format (bidi) and separators."""
    return [c for c in text if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") or c in "\x7f"]


def test_printable_escapes_every_control_and_keeps_the_text():
    out = printable(HOSTILE)
    assert controls(out) == []
    for escape in (r"\x1b", r"\x07", r"\u202e", r"\x9b", r"\u2066", r"\r", r"\n", r"\x00", r"back\\slash"):
        assert escape in out, (escape, out)
    assert printable("erreur: périphérique 中文 ok") == "erreur: périphérique 中文 ok"  # printable text untouched
    assert controls(HOSTILE) != []  # the negative control: the raw text does hold them


def test_a_hostile_farewell_reaches_the_error_line_escaped():
    """The far end of a link says farewell with ESC, BEL, CSI and U+202E in its line: the PeerLeft
    the receiver raises (its message is what `fusion generate` prints, what /health and the logs
    carry) holds none of them raw."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    mine, theirs = Link(a, None, 2, "worker 2"), Link(b, None, 1, "worker 1")
    theirs.farewell(HOSTILE.replace("\r\n", " "), time.monotonic() + 2)
    with pytest.raises(PeerLeft) as e:
        mine.recv_size(time.monotonic() + 2)
    assert controls(str(e.value)) == [] and controls(e.value.said or "") == []
    assert r"\x1b]0;pwned\x07" in str(e.value)
    mine.close()
    theirs.close()
    # a payload that is not JSON is taken as the line, escaped the same way
    assert controls(farewell_reason(HOSTILE.encode())["why"]) == []


def test_a_local_workers_last_words_are_escaped():
    said = last_words("starting\nfusion worker: error: \x1b[2Jbad \u202eline\n", 1)
    assert controls(said) == [] and said.startswith("fusion worker: error: \\x1b[2Jbad")
