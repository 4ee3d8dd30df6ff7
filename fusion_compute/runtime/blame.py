"""Who is to blame when a data link fails while every pulse still beats (docs/resilience.md, "Blame by
evidence"), and when an ambiguity has followed one worker: rules on evidence only, no processes.

The evidence, per worker of the epoch (participant ids):

  its account    (liveness.Witness, asked on its pulse link) `lost`: the peer whose link failed it
                 first-hand (closed without a farewell, or silent past the deadline); `after`: the
                 peer whose farewell made it leave (a knock-on close: no evidence against anyone);
                 `waits`: how long each peer alone kept it waiting; `waiting`: the peers it is
                 blocked on now.
  the client's   (trusted: the user's process) what its own link to the worker says: "left" with the
                 farewell's reason (cause / after / why), "closed" without one, or "open" (it never
                 left); whose step output it was still owed when the link failed (`owed`: those had
                 been sent the whole step and not answered); and how long each worker alone kept the
                 client waiting.

An honest worker whose link fails leaves the epoch at once and says why on every link (links.
say_farewell). So:

  1. An accusation counts only when its maker left naming that peer on its link to the client: a
     worker that says a peer failed it but stayed, closed silently or named someone else when it left
     has no accusation (its account contradicts what the client saw).
  2. A worker that left naming nobody (its own error) is the one to remove, by its own word.
  3. A worker accused by a counted accusation is removed when it did not leave (its link to the
     client still open, or closed without a word), still owed the client its step's output, and
     says it waits on no peer (so nothing kept it from going on, or from leaving): evidence from two
     sides, its accuser's and the client's own. (The engine first gives an accused worker that says it
     is computing the per-message timeout to finish, leave or wait on someone: membership._blame.)
  4. Counted accusations that do not meet 3 (the accused left too: knock-on, or naming its accuser)
     leave an ambiguous set: the accused and their accusers. Nobody can be removed on it.
  5. A worker that left saying its own block failed though its inputs had passed their checks (its
     farewell's `inputs`: comm's TaintedInputs) names nobody: when 2 and 3 name no one, every
     worker of the epoch (each sent it something) is in the ambiguous set, the accused first.
  6. No counted accusation: the waits decide, by the step deadline's rule (deadline.judge: consistent
     cause, corroborated by the client or two workers; one worker's word alone is ambiguous).

Farewells checked against what else the client holds (issue 41):

  - A worker whose farewell to the client and whose own account disagree (the account names a peer,
    `lost` or `after`, and the farewell names another, or the same one as the other kind) lied in
    one of them: it is removed, with 2 and 3. An honest worker records its account and says its
    farewell from the one error that ended its epoch (structural/worker.py, Worker._leaving).
  - Two workers that each say they left after the other's farewell: an honest worker's farewell
    carries the reason it decided before sending it, so the two cannot both be true; one of them
    lies, and the client cannot tell which: both go into the ambiguous set (with 4, 5). The same
    around three or more (q after x, x after y, y after q): every such ring holds a liar, and
    all of it goes into the ambiguous set.
  - A worker that says it left after the farewell of a peer that never left (its link to the client
    open, its own account naming nobody it lost or left after, and blocked on the claimant now): an
    honest peer that said a farewell has left, so one of the two lies: both go into the ambiguous
    set, the claimant first (issue 43's red team; before, nobody was suspected: a denial of service
    the liar could repeat at no cost).
  - Not a contradiction the client can settle: "I left after X" while X's farewell names the
    claimant as its first-hand cause. A liar X can name an honest peer in its farewell to the client
    and say anything on its link to that peer, which then honestly leaves after X; or the claimant
    is the liar, having cut its link to X. Both leave the same evidence, so removing the claimant
    would remove an honest worker in the first case (tests/test_blame.py, the exhaustive test): the
    pair stays ambiguous (4), and the ambiguity that follows the liar (`follows`) removes it.

A counted accusation may be about poisoned values: a worker leaves naming the peer whose block it
refused (comm's PeerPoisoned: a NaN, an infinity or a value over the bound, which the sender's own
check refuses to send), and the rules above weigh it as any first-hand cause.

What an ambiguous set leads to is membership.py's: its workers are set aside for standbys (none
barred), and `follows` names a worker once ambiguity has followed it: a worker in two ambiguous sets
that share nobody else. That is sound only over sets that each hold the liar, so only those count
(the verdict's `liar_only`): the sets rules 4, 5 and the farewell checks make (with one liar, every
one holds it: the exhaustive tests) and the client's own value checks' suspects. A set judged on
waits (rule 6, and every slow-step verdict: deadline.judge on one worker's word) can be two honest
workers on a loaded machine, with the liar a standby: it sets its workers aside all the same, and
never feeds `follows`, neither as history nor as the set just made (either way a liar's later or
earlier pair with one of them would share only that honest worker). With one liar, then, every set
`follows` sees holds the liar, and an honest worker is never in two that share only it. The cost: a
liar that only drags is never removed by `follows` (docs/resilience.md, "What the rule guarantees").
"""

from __future__ import annotations

from .deadline import CLIENT, Verdict, judge


def blame_link(
    accounts: dict[int, dict],
    seen: dict[int, tuple[str, dict | None]],
    workers: list[int],
    owed: set[int],
    blocked: dict[int, dict[int, float]],
    threshold_s: float,
) -> tuple[set[int], Verdict]:
    """Apply the rules above. `accounts[q]`: {"lost", "after", "waits", "waiting"} in participant ids
    (a worker that did not answer has none); `owed`: the workers whose step output the client was
    still waiting for when the link failed (none when it failed before that); `seen[q]`: the client's view of q's link, (state, reason) with the
    reason's "cause"/"after" in participant ids (CLIENT for the client); `blocked`: every account of
    waits, the client's under CLIENT. Returns who to remove (may be empty) and the verdict: its
    `causes` are the ambiguous set when nobody is removed, and `said` the evidence in words."""
    counted: dict[int, int] = {}
    words = []
    for q in workers:
        p = (accounts.get(q) or {}).get("lost")
        if not isinstance(p, int) or p == q or p not in workers:
            continue
        state, reason = seen.get(q, ("open", None))
        if state == "left" and reason is not None and reason.get("cause") == p:
            counted[q] = p
            words.append(f"worker {q} left naming worker {p}")
        else:
            words.append(f"worker {q} names worker {p} but did not leave naming it ({state}): not counted")
    left: dict[int, dict] = {}  # who left with a farewell, and what it said
    for q in workers:
        state, reason = seen.get(q, ("open", None))
        if state == "left" and reason is not None:
            left[q] = reason
    tainted = {q for q, reason in left.items() if reason.get("inputs") and reason.get("cause") is None}
    own = {
        q
        for q, reason in left.items()
        if reason.get("cause") is None and reason.get("after") is None and q not in tainted
    }
    for q in sorted(own):
        words.append(f"worker {q} left on its own error ({(seen[q][1] or {}).get('why') or 'no reason given'})")
    named = set(own)
    for q, reason in sorted(left.items()):  # its farewell against its own account
        claim = ((accounts.get(q) or {}).get("lost"), (accounts.get(q) or {}).get("after"))
        if claim != (None, None) and claim != (reason.get("cause"), reason.get("after")):
            named.add(q)
            words.append(
                f"worker {q}'s farewell (cause {reason.get('cause')}, after {reason.get('after')}) contradicts "
                f"its own account (lost {claim[0]}, after {claim[1]})"
            )
    mutual = sorted(
        (q, x)
        for q, reason in left.items()
        if (x := reason.get("after")) in left and left[x].get("after") == q and q < x
    )
    for q, x in mutual:
        words.append(f"workers {q} and {x} each say they left after the other's farewell: one of them lies")
    rings = [list(pair) for pair in mutual] + _after_rings(left)
    for ring in rings[len(mutual) :]:  # the same, around three or more
        words.append(
            f"workers {ring} each say they left after the next one's farewell, the last after the first: one lies"
        )
    unmoved = _after_the_unmoved(left, seen, accounts, workers)
    for q, x in unmoved:
        words.append(
            f"worker {q} says it left after worker {x}'s farewell, but worker {x} never left: it says it "
            f"waits on worker {q}: one of them lies"
        )
    for p in sorted(set(counted.values())):
        stayed = seen.get(p, ("open", None))[0] != "left"
        blocked_on = (accounts.get(p) or {}).get("waiting") or []
        if stayed and p in owed and not blocked_on and p not in counted:
            named.add(p)
            words.append(f"worker {p} never left nor answered its step, waiting on nobody")
        elif stayed and blocked_on:
            words.append(f"worker {p} says it waits on worker{'s' if len(blocked_on) > 1 else ''} {blocked_on}")
    if named:
        return named, Verdict(min(named) if len(named) == 1 else None, tuple(sorted(named)), "; ".join(words))
    if tainted:
        for q in sorted(tainted):
            words.append(f"worker {q} left: its own block failed though its inputs had passed (it names nobody)")
        accused = sorted(set(counted.values()))
        pairs = [w for ring in [*rings, *unmoved] for w in ring]
        causes = tuple(dict.fromkeys(accused + sorted(counted) + pairs + sorted(tainted) + sorted(workers)))
        return set(), Verdict(None, causes, "; ".join(words), liar_only=True)
    if counted or rings:
        accused = sorted(set(counted.values()))
        pairs = [w for ring in [*rings, *unmoved] for w in ring]
        causes = tuple(dict.fromkeys(accused + sorted(counted) + pairs))
        return set(), Verdict(None, causes, "; ".join(words), liar_only=True)
    verdict = judge(blocked, workers, threshold_s)
    said = "; ".join([*words, verdict.said])
    if unmoved and verdict.named is None:  # the waits name nobody: the pairs, each holding the liar
        causes = tuple(dict.fromkeys(w for pair in unmoved for w in pair))
        return set(), Verdict(None, causes, said, liar_only=True)
    # waits only (rule 6): an ambiguous set here can be two honest workers on a loaded machine (liar_only False)
    return ({verdict.named} if verdict.named is not None else set()), Verdict(verdict.named, verdict.causes, said)


def _after_the_unmoved(
    left: dict[int, dict], seen: dict[int, tuple[str, dict | None]], accounts: dict[int, dict], workers: list[int]
) -> list[tuple[int, int]]:
    """The pairs (q, x) where q left saying it left after x's farewell while x never left: its link
    to the client open, its own account of this epoch naming no peer it left after or lost, and
    blocked on q now. An honest x that said a farewell left the epoch first: the error that ended
    it is in its account (`lost` or `after`, a PeerError's) or was its own, outside any wait (comm
    clears `waiting` when a wait ends, and an error inside one is a PeerError); so an honest x is
    not still waiting on q after saying farewell to it. Either q lies (the red team's "after a peer
    that never left": before, nobody was suspected and the request failed each time) or x lies in
    its account (it said farewell to q and stays): each pair holds the liar, and the pair is
    ambiguous, the claimant first (after the waits: a claimant its peers' waits name is removed by
    rule 6 first). Without x's account (it did not answer) the pair is not made: x's farewell to
    the client may still be on its way."""
    pairs = []
    for q, reason in sorted(left.items()):
        x = reason.get("after")
        if not isinstance(x, int) or x == q or x not in workers or x in left:
            continue
        said = accounts.get(x)
        if seen.get(x, ("open", None))[0] != "open" or said is None:
            continue
        if said.get("lost") is None and said.get("after") is None and q in (said.get("waiting") or []):
            pairs.append((q, x))
    return pairs


def _after_rings(left: dict[int, dict]) -> list[list[int]]:
    """The cycles of three or more workers in the farewells' `after` (q left after x, x after y, ...,
    back to q), each from its lowest id. An honest worker's `after` names a farewell that came before
    it decided, so honest claims alone never close a cycle: each one holds a liar (issue 41's red
    team: a liar in a ring with two honest workers otherwise made no suspect at all)."""
    rings = []
    for start in sorted(left):
        path: list[int] = []
        q = start
        while q in left and q not in path:
            path.append(q)
            after = left[q].get("after")
            if not isinstance(after, int):  # no `after` (None): the chain ends here, no ring
                break
            q = after
        if q == start and len(path) >= 3 and start == min(path):
            rings.append(path)
    return rings


def follows(history: list[frozenset[int]], causes: tuple[int, ...]) -> int | None:
    """The worker an ambiguity has followed: in `causes` and in an earlier ambiguous set that shares
    no other worker with it (two different partners, the same suspect). None when no single worker
    is. `history` is the job's earlier ambiguous sets (the caller appends this one); both it and
    `causes` must be `liar_only` sets (above): a set judged on waits is never passed here."""
    now = frozenset(causes)
    hits = {x for x in now for before in history if before & now == {x}}
    return hits.pop() if len(hits) == 1 else None


__all__ = ["CLIENT", "blame_link", "follows"]
