"""Red team of the masked mode's promises (docs/masked.md), as a curious member and as a lying one.

Product check (masked/verify.py), a lying member:
  - the check's secret U must be all fresh OS randomness: a U expanded from a 63-bit seed (as it
    was) lets a liar who guesses the seed return an error in U's null space (a short integer lattice
    vector, LLL) that passes; so the per-trial bound could not be 2^-64. Fixed: every entry of U is
    read from os.urandom.
  - the escape rate of the best lies (one entry off, or two entries off in opposite directions)
    measured against the bound 2^-(U_BITS · D), at a reduced width where it is measurable.
Mask freshness, a curious member of A:
  - every mask ring word the client draws, over a job that prefills, decodes, speculates (rolled
    back and re-run at the same positions with other tokens), verifies a token tree, batches
    sessions that join and leave, replays after a member is revoked, and retries after a lie was
    caught, is drawn once: no pad covers two plaintexts; and no two messages A received, compared
    pairwise, differ by small values (what A would see of a reused pad).
  - the masked audit's rule 5 against masks broken on purpose: clear, 48-bit, table-drawn and one
    pad for all fail it; so do a pad reused across sessions and one from a non-consecutive step
    (its any-pair check, audit.pad_reuse: these passed rule 5 when it compared each message only
    with the same linear's previous one), found among 3,000 messages too, and by audit.verify in a
    participant's view across two epochs at two ranks; a weak key passes it.
What a member's view discloses: A's control words are [FORWARD, T, 0, 0], and the widths T disclose
what docs/masked.md lists (lengths, session starts, batch size, draft counts, a replay's length).
A coalition with a member in every group: the handshake's metadata (row exponents, norms), which
the product check does not cover, is compared with the client's own quantization (fixed: it was
compared only between groups, so an agreed lie halved a row's output with every product passing).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from inproc import masked_threads
from test_masked_verify import honest_product, product_check

from fusion_compute.masked import verify


def null_vector(u_DN: torch.Tensor, cols: int = 24) -> torch.Tensor:
    """A short nonzero integer e (N,) with U e = 0 exactly, supported on U's first `cols` columns:
    LLL on the lattice [I | 2^40 U^T], whose short vectors have U e = 0 (what a liar who knows U
    returns: an error the check cannot see)."""
    from sympy import ZZ
    from sympy.polys.matrices import DomainMatrix

    d = u_DN.shape[0]
    rows = [[int(i == j) for j in range(cols)] + [int(u_DN[r, i]) << 40 for r in range(d)] for i in range(cols)]
    for vec in DomainMatrix(rows, (cols, cols + d), ZZ).lll().to_Matrix().tolist():
        if all(v == 0 for v in vec[cols:]) and any(vec[:cols]):
            e = torch.zeros(u_DN.shape[1], dtype=torch.int64)
            e[:cols] = torch.tensor(vec[:cols], dtype=torch.int64)
            assert bool(((u_DN @ e) == 0).all())
            return e
    raise AssertionError("LLL found no null vector")


def test_the_checks_secret_is_all_fresh_os_randomness(tiny_qwen2, monkeypatch):
    """Every entry of every U is read from the OS CSPRNG: at least 16 bits per entry, D rows per linear.
    (Before the fix the whole job's U came from 8 bytes, a 63-bit seed for torch's Mersenne Twister.)"""
    drawn: list[int] = []
    real = verify._urandom
    monkeypatch.setattr(verify, "_urandom", lambda n: drawn.append(n) or real(n))
    chk = product_check(tiny_qwen2)
    need = sum(2 * verify.BASIS_ROWS * s.rows for s in chk.plan.shapes) * chk.plan.config.n_layers
    assert sum(drawn) >= need, (sum(drawn), need)
    # and no two linears share their U (each is its own draw)
    us = [lin.u.tobytes() for lin in chk.lin.values()]
    assert len(set(us)) == len(us)


def test_a_lie_in_the_null_space_of_a_guessed_U_is_caught(tiny_qwen2, monkeypatch):
    """The liar's best attack on a per-job U: guess the client's secret and lie in its null space.

    Control first: against the true U (what the liar would need), a short lattice vector passes the
    check, so the check's blind subspace exists and only U's secrecy guards it. Then the liar is
    handed the first 8 bytes the client read from the OS (the whole seed before the fix: 2^63 guesses
    cover them, so each guess passed with probability 2^-63, more than the 2^-64 claimed) and
    rebuilds U as a seeded generator would: its lie must be caught."""
    drawn: list[bytes] = []
    real = verify._urandom
    monkeypatch.setattr(verify, "_urandom", lambda n: drawn.append(real(n)) or drawn[-1])
    chk = product_check(tiny_qwen2)
    gen = torch.Generator().manual_seed(7)
    layer, op = 0, 0
    x_fx, y = honest_product(chk, layer, op, 2, gen)
    assert chk.check(layer, op, y, x_fx)

    true_u = torch.from_numpy(chk.lin[(layer, op)].u).to(torch.int64)
    lie = y.clone()
    lie[:, 1] += null_vector(true_u)
    assert not torch.equal(lie, y)
    assert chk.check(layer, op, lie, x_fx), "control: a lie in U's null space passes when U is known"

    # the seed a generator-expanded U came from, rebuilt in the precompute's order
    seeded = torch.Generator().manual_seed(int.from_bytes(b"".join(drawn)[:8], "little") >> 1)
    guess = {}
    for lay in range(chk.plan.config.n_layers):
        for s in chk.plan.shapes:
            guess[(lay, s.op)] = torch.randint(
                0, 1 << verify.U_BITS, (verify.BASIS_ROWS, s.rows), generator=seeded, dtype=torch.int64
            )
    lie = y.clone()
    lie[:, 1] += null_vector(guess[(layer, op)])
    assert not chk.check(layer, op, lie, x_fx), "a liar who knows 64 bits of the client's randomness passed"


@pytest.mark.parametrize("rows", [1, 2])
def test_escape_rate_of_the_best_lies_matches_the_bound(tiny_qwen2, monkeypatch, rows):
    """Measured at a reduced width, where escapes happen often enough to count: U entries of 4 bits,
    D = 1 or 2 rows, so the documented per-trial bound is 2^-(4 D). Two lies that meet it: one
    entry off by an odd amount (passes iff U[:, i] = 0), and two entries off by +c and -c (passes
    iff U[:, i] = U[:, j]). Each trial is one row of one linear under a fresh U (one per job), so the
    trials are independent. The rate must sit within 6 sigma of the bound, not above it."""
    monkeypatch.setattr(verify, "U_BITS", 4)
    monkeypatch.setattr(verify, "BASIS_ROWS", rows)
    bound = 2.0 ** -(4 * rows)
    gen = torch.Generator().manual_seed(11)
    escaped = {"one": 0, "pair": 0}
    trials = 0
    jobs = 6 if rows == 1 else 12
    for _ in range(jobs):
        chk = product_check(tiny_qwen2)
        for (layer, op), _lin in chk.lin.items():
            x_fx, y = honest_product(chk, layer, op, 1, gen)
            n = y.shape[0]
            for i in range(n):
                one = y.clone()
                one[i, 0] += 3
                pair = y.clone()
                pair[i, 0] += 5
                pair[(i + 1) % n, 0] -= 5
                escaped["one"] += chk.check(layer, op, one, x_fx)
                escaped["pair"] += chk.check(layer, op, pair, x_fx)
                trials += 1
    sigma = (bound * (1 - bound) / trials) ** 0.5
    for kind, k in escaped.items():
        rate = k / trials
        print(f"D={rows} U_BITS=4 {kind}: {k}/{trials} = {rate:.5f} (bound {bound:.5f})")
        assert abs(rate - bound) <= 6 * sigma, (kind, k, trials, bound)


# ---- mask freshness: every pad covers one plaintext, whatever the job does ----


def close_pairs(view: list[np.ndarray], sample: int = 64) -> tuple[float, int]:
    """What a member of A can compute from what it received: for every pair of messages, the
    fraction of their first `sample` words in the order a pad is drawn (a (K, T) message row-major:
    element [k, t] is pad word k T + t, whatever T) whose difference mod 2^64 is below 2^56 in
    size. Independent pads: ~2^-7. One pad under two plaintexts: ~1 (the difference is then
    x - x', small fixed-point values), even when the two messages have different T. Returns the
    largest fraction over all pairs, and the number of pairs."""
    block = np.stack([np.ascontiguousarray(m).reshape(-1)[:sample].view("<u8") for m in view])  # (M, sample)
    worst, pairs, lim = 0.0, 0, np.uint64(1 << 56)
    for i in range(len(block) - 1):
        d = block[i + 1 :] - block[i]  # wraps mod 2^64
        close = (d < lim) | (d > ~lim)  # |d| < 2^56 as a signed difference
        worst = max(worst, float(close.mean(1).max()))
        pairs += len(d)
    return worst, pairs


def _a_views(d) -> dict[int, list[np.ndarray]]:
    """Every A member's received masked messages over the whole job, by participant (a member keeps
    its view across epochs, whatever rank each epoch gives it), from the audit taps in order."""
    from fusion_compute.masked import audit

    out: dict[int, list[np.ndarray]] = {}
    for ep in (r for r in audit.read_log(d, 0) if r["type"] == "epoch"):
        for rank, group in audit.groups_by_rank(ep["groups"]).items():
            if group == "A":
                out.setdefault(ep["order"][rank - 1], []).extend(m for _, m in audit.read_tap(d, rank, ep["epoch"]))
    return out


@pytest.mark.slow
def test_no_mask_covers_two_plaintexts_through_every_path(tiny_qwen2, tmp_path, monkeypatch):
    """One job of workers as threads (2+1, a standby per group) that goes through every path that
    could draw a pad twice: prefill and decode; a speculative chain rolled back and re-run at the
    same positions with other tokens; a token tree and its kept path; a batch that a session joins,
    one leaves and another joins at the same step numbers; a revoked member replaced and the open
    sessions replayed; a lie caught (the request fails) and the request retried. The client's every
    mask word is recorded (r = Σ r_g as drawn) and A's every received message read back from its
    audit tap. Promised: no mask word is drawn twice in the job, and no two messages A received
    (any pair, not only consecutive ones) share a pad."""
    from fusion_compute.errors import WorkerMisbehaved
    from fusion_compute.masked import client as masked_client
    from fusion_compute.masked.client import MaskedEngine
    from fusion_compute.masked.worker import MaskedWorker

    words: list[torch.Tensor] = []
    real_stream = masked_client.make_stream

    def recording_stream(kind, key, *, guard):
        stream = real_stream(kind, key, guard=guard)
        draw = stream.draw
        stream.draw = lambda *a: words.append(draw(*a)) or words[-1]  # type: ignore[method-assign]
        return stream

    monkeypatch.setattr(masked_client, "make_stream", recording_stream)
    lie = {"armed": False, "told": 0}
    honest_answer = MaskedWorker.answer

    def answer(self, name, y, first, last):  # A's first member lies once, when armed
        y = honest_answer(self, name, y, first, last)
        if lie["armed"] and self.group == "A" and self.member == 0 and first:
            lie["armed"], lie["told"] = False, lie["told"] + 1
            return y + 1
        return y

    monkeypatch.setattr(MaskedWorker, "answer", answer)
    to_a: list[tuple[int, list[int]]] = []  # (rank, word): every control word the client sent A in steps
    real_isend = MaskedEngine._isend

    def isend(self, tensor, rank, kind, op):
        if kind == "control" and self.plan.group_of(rank)[0] == "A":
            to_a.append((rank, tensor.tolist()))
        return real_isend(self, tensor, rank, kind, op)

    monkeypatch.setattr(MaskedEngine, "_isend", isend)
    d = tmp_path / "audit"
    opts = masked_threads(n_a=2, n_b=1, standby=1, timeout_s=60, context=64, audit_dir=str(d))
    prompt = [7, 7, 7, 7, 30, 31, 7, 7]  # repeated tokens: identical clear inputs, the worst case
    with MaskedEngine(tiny_qwen2, opts) as eng:
        eng.batch_slots = 3  # what fusion serve --max-batch 3 sets
        eng.reset()
        eng.forward(prompt)
        eng.forward([5])
        eng.forward([6, 8, 9])  # a draft chain: 8 and 9 rejected,
        eng.rollback(0, len(prompt) + 2)
        eng.forward([10, 11])  # re-verified at the same positions with other tokens
        eng.forward_batch([(0, [12, 13, 14, 15])], trees={0: (-1, 0, 0, 1)})
        eng.keep_path(0, [0, 2])
        eng.forward([16])
        eng.forward_batch([(0, [17]), (1, prompt[:5])])  # a session joins the batch
        eng.forward_batch([(0, [18]), (1, [19])])
        eng.release(1)  # leaves
        eng.forward_batch([(0, [20]), (2, prompt[:3])])  # another joins: the same step numbers go on
        eng.revoke(eng.order[1])  # A's second member: a standby takes its seat, both slots replayed
        assert eng.recoveries and eng.recoveries[-1]["replayed_tokens"] > 0
        eng.forward_batch([(0, [21]), (2, [22])])
        eng.release(2)
        lie["armed"] = True
        with pytest.raises(WorkerMisbehaved):
            eng.forward([23])
        assert lie["told"] == 1
        eng.reset()  # the request retried from the start, without the liar
        eng.forward(prompt)
        eng.forward([24])
        sessions = eng.session + 1

    # What A is told: the step's width T and nothing else (no position, step, session or slot); the
    # widths themselves are the documented metadata: here prompt 8, decode 1, a 3-draft chain, its
    # re-run 2, a 4-column tree, 1, a 5-token session joining a decode (6), 2, a 3-token one (4)
    from fusion_compute.masked import protocol as P

    assert all(w[0] == int(P.Op.FORWARD) and w[2:] == [0, 0] for _, w in to_a), to_a
    widths = [w[1] for rank, w in to_a if rank == 1]  # every epoch has a rank 1, in A
    # ... then the replay after the revocation, one session per step: 18 and 3, each open session's
    # whole length so far; 2; the step the lie ended (1); the retried request's prompt and decode
    assert widths == [8, 1, 3, 2, 4, 1, 6, 2, 4, 18, 3, 2, 1, 8, 1], widths
    allw = torch.cat(words)
    assert sessions >= 3 and allw.numel() > 50_000
    assert torch.unique(allw).numel() == allw.numel(), "a mask word was drawn twice"
    views = _a_views(d)
    assert len(views) == 3  # A's two members and the standby that replaced one
    total = 0
    for name, view in views.items():
        worst, pairs = close_pairs(view)
        total += pairs
        assert worst < 0.5, (name, worst)
    assert total > 5_000
    # the audit's own rule 5 agrees, over the same views (one per participant, across the epochs)
    from fusion_compute.masked import audit

    report = audit.verify(d)
    assert report["ok"], report["violations"]
    assert len(report["a_views"]) == 3
    assert sorted(v["messages"] for v in report["a_views"].values()) == sorted(len(v) for v in views.values())
    # the detector's control: a message A received and the same pad over other small data are flagged
    a = max(views.values(), key=len)[0]
    other = (a.view("<u8") + np.arange(a.size, dtype="<u8").reshape(a.shape) * np.uint64(1 << 40)).view("<i8")
    assert close_pairs([a, other])[0] == 1.0


# ---- the masked audit's rule 5 against masks broken on purpose ----

LINEAR_KS = (72, 72, 72, 100)  # tiny Qwen2's K per linear: qkv, o, gate_up, down


def _plaintexts(gen: torch.Generator, k: int, t: int) -> torch.Tensor:
    """Fixed-point inputs of the size the client encodes (|x_fx| < 2^52, most far below)."""
    return (torch.randn(k, t, generator=gen, dtype=torch.float64) * 2.0**44).round().to(torch.int64)


def _view(pads, steps=(8, 1, 1, 1, 1, 1), layers: int = 3, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """What one member of A receives over a session of `steps` (T per step): x_fx + pad, every
    linear of every layer, with `pads(step, layer, op, n)` the masks (broken on purpose or not)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step, t in enumerate(steps):
        for layer in range(layers):
            for op, k in enumerate(LINEAR_KS):
                m = _plaintexts(gen, k, t) + pads(step, layer, op, k * t).view(k, t)
                out.append((f"L{layer}.op{op}", m.numpy()))
    return out


def _rule5(view: list[tuple[str, np.ndarray]]) -> dict[str, bool]:
    from fusion_compute.masked import audit

    words = np.concatenate([m.ravel() for _, m in view])
    fresh = audit.freshness(view)
    return {
        "uniform": audit.uniformity(words)["ok"],
        "within": bool(fresh["within"]["ok"]),
        "across_steps": bool(fresh["across_steps"]["ok"]),
        "any_pair": bool(audit.pad_reuse([m for _, m in view])["ok"]),
    }


def _stream(key: bytes = b"k" * 32):
    from fusion_compute.masked.masks import MaskStream

    return MaskStream(key, guard=True).draw


def test_audit_rule5_passes_fresh_masks_and_fails_the_broken_ones_it_claims():
    """Honest ChaCha20 masks pass; a clear view (r = 0), masks of 48 bits, masks drawn from a table
    of 256 words, and one pad for every message (the same r each time) each fail rule 5."""
    assert all(_rule5(_view(_stream())).values())
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(-(1 << 62), 1 << 62, (256,), generator=gen) * 2
    one_pad = _stream()(0, 0, 0, 100 * 8)
    broken = {
        "clear": lambda s, ly, o, n: torch.zeros(n, dtype=torch.int64),
        "48-bit": lambda s, ly, o, n: _stream()(s, ly, o, n) >> 16,
        "table-256": lambda s, ly, o, n: table[torch.randint(0, 256, (n,), generator=gen)],
        "one pad": lambda s, ly, o, n: one_pad[:n],
    }
    for name, pads in broken.items():
        verdict = _rule5(_view(pads))
        assert not all(verdict.values()), (name, verdict)


@pytest.mark.parametrize("reuse", ["key repeated next session", "pad of two steps before"])
def test_audit_rule5_catches_a_pad_reused_anywhere_in_a_view(reuse):
    """Pads reused where the consecutive comparison (across_steps) does not look: under a key repeated
    in the next session (labels restart, T differs), and from two steps before. The any-pair check
    fails the view, naming pairs that do share a pad (their plaintexts subtract to small values)."""
    draw = _stream()
    if reuse == "key repeated next session":
        # two sessions under one key: session 2's step s reuses session 1's pads (labels restart at 0)
        first = _view(lambda s, ly, o, n: draw(s, ly, o, n), steps=(8, 1, 1))
        again = _stream()  # the same key
        view = first + _view(lambda s, ly, o, n: again(s, ly, o, n), steps=(5, 1, 1), seed=1)
    else:
        # a step counter that lags by two: steps 2, 3, ... reuse the pads of steps 0, 1, ...
        view = _view(lambda s, ly, o, n: _stream()(max(s - 2, 0) if s > 1 else s, ly, o, n))
    # what A itself sees in that view: a pair of its messages whose difference is small everywhere
    assert close_pairs([m for _, m in view])[0] == 1.0
    verdict = _rule5(view)
    assert verdict["uniform"] and verdict["within"] and verdict["across_steps"], verdict  # what it passed before
    assert not verdict["any_pair"], "a view in which two messages share a pad passed rule 5"
    from fusion_compute.masked import audit

    found = audit.pad_reuse([m for _, m in view])["reused"]
    assert found and all(p["close_fraction"] == 1.0 for p in found), found
    for p in found:  # each named pair is one pad: its two messages' op is the same, and A sees it
        (op_i, a), (op_j, b) = view[p["messages"][0]], view[p["messages"][1]]
        assert op_i == op_j and close_pairs([a, b])[0] == 1.0, p


def test_audit_rule5_finds_one_reused_pad_among_thousands_of_messages():
    """The any-pair check at scale, both ways: 3,000 messages of independent pads pass (a negative
    control: candidates from bucket collisions, none confirmed); the same view with one message
    replaced by other plaintexts under message 17's pad fails, naming exactly that pair."""
    from fusion_compute.masked import audit

    gen = torch.Generator().manual_seed(5)
    draw = _stream()
    pads = [draw(i, 0, 0, 72 * (1 + i % 3)) for i in range(3000)]  # T = 1..3: pad words 72 T
    view = [(_plaintexts(gen, 72, p.numel() // 72).view(-1) + p).view(72, -1).numpy() for p in pads]
    clean = audit.pad_reuse(view)
    assert clean["ok"] and clean["messages"] == 3000 and clean["short"] == 0, clean
    view[2500] = (_plaintexts(gen, 72, 1).view(-1) + pads[17][:72]).view(72, 1).numpy()  # 17's pad, T = 1
    found = audit.pad_reuse(view)
    assert not found["ok"] and [p["messages"] for p in found["reused"]] == [[17, 2500]], found


def _two_epoch_audit(d, reuse: bool):
    """An audit folder written through AuditLog as a 2+1 job would, over two epochs in which A's two
    participants (1 and 2) swap ranks; each A rank receives 12 messages per epoch (masked under
    fresh pads), and with `reuse` participant 1's last message of epoch 1 (at rank 2) reuses the
    pad of its first message of epoch 0 (at rank 1)."""
    from fusion_compute.masked import audit

    gen = torch.Generator().manual_seed(9)
    sizes = (2, 1)
    client = audit.AuditLog(d, 0, "client", None, sizes)
    client.session(0, ["key0"])
    for epoch, order in ((0, [1, 2, 3]), (1, [2, 1, 3])):
        client.epoch(epoch, sizes, order)
        for rank in (1, 2, 3):
            log = audit.AuditLog(d, rank, "worker", "A" if rank < 3 else "B", sizes, epoch=epoch)
            for i in range(12 if rank < 3 else 0):
                label = (epoch * 100 + order[rank - 1] * 10 + i, 0, 0)  # every pad its own
                if reuse and (epoch, order[rank - 1], i) == (1, 1, 11):
                    label = (10, 0, 0)  # participant 1's first pad, epoch 0
                log.tap("L0.qkv", _plaintexts(gen, 72, 2) + _stream()(*label, 144).view(72, 2))
            log.close()
    client.close()


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reused-across-epochs"])
def test_audit_verify_follows_a_participant_across_epochs(tmp_path, reuse):
    """audit.verify gathers each participant's view across epochs, whatever rank it held: a pad
    that participant 1 received at rank 1 in epoch 0 and again at rank 2 in epoch 1 fails rule 5,
    named with both seats; the same folder with fresh pads passes (negative control). Grouped by
    rank instead, the two messages would sit in different views and pass."""
    from fusion_compute.masked import audit

    _two_epoch_audit(tmp_path, reuse)
    report = audit.verify(tmp_path)
    if not reuse:
        assert report["ok"], report["violations"]
        assert set(report["a_views"]) == {"participant1", "participant2"}
        assert report["a_views"]["participant1"]["ranks"] == [[0, 1], [1, 2]]
        return
    assert report["violations"] == [
        "participant 1 (A; rank 1, epoch 1 rank 2): masks not fresh any_pair: 1 pair(s) of its messages"
        " share a pad (first: L0.qkv of epoch 0 rank 1 and L0.qkv of epoch 1 rank 2, close in 1.000"
        " of 112 words)"
    ], report["violations"]
    assert [p["messages"] for p in report["a_views"]["participant1"]["reused"]] == [[0, 23]]


def test_a_weak_key_passes_rule5_yet_a_member_of_A_reads_the_data():
    """What no statistic on A's view can see, documented as such: masks from a key with 12 bits of
    entropy are ChaCha20 output, uniform and fresh, and pass rule 5; A, trying every key, finds the
    one whose pad leaves small values and reads x_fx exactly. Rule 5 checks the masks' use, not the
    key's strength (the client's keys are 32 bytes of os.urandom: masks.new_key)."""
    secret = 0x5A3
    key_of = lambda i: i.to_bytes(2, "little") + bytes(30)  # noqa: E731
    view = _view(lambda s, ly, o, n: _stream(key_of(secret))(s, ly, o, n))
    assert all(_rule5(view).values())
    name, m = view[0]  # step 0, layer 0, qkv: A's first message
    first = torch.from_numpy(m.copy())
    for guess in range(1 << 12):
        x = first - _stream(key_of(guess))(0, 0, 0, first.numel()).view(first.shape)
        if bool((x.abs() < (1 << 52)).all()):
            break
    assert guess == secret
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(x, _plaintexts(gen, *first.shape))  # the client's fixed-point input, exactly


# ---- a coalition of every group, lying where no product is checked ----


@pytest.mark.slow
def test_metadata_every_group_agrees_on_is_checked_against_the_clients_own(tiny_qwen2, monkeypatch):
    """The client rescales each output row by 2^-e_i and sizes its inputs from the row norms, both
    reported by the workers at the handshake and compared only between groups. A member of every
    group (here: both workers of a 1+1 job, as threads) reporting e_i + 1 for one row halves that
    row's output while every product passes the check. With the check off the lie goes through (the
    logits move: what it would do); with it on, start-up is refused: the client compares the
    metadata with its own quantization of the weights (before the fix: accepted, logits wrong)."""
    from fusion_compute.masked import worker
    from fusion_compute.masked.client import MaskedEngine
    from fusion_compute.model.config import ModelError

    def opts(**kw):
        return masked_threads(**{"n_a": 1, "n_b": 1, "timeout_s": 60, "context": 64, **kw})

    ids = [1, 5, 9, 200, 3]
    with MaskedEngine(tiny_qwen2, opts(verify=False)) as eng:
        eng.reset()
        clean = eng.forward(ids, all_logits=True)
    honest_load = worker.load_member

    def coalition(src, plan, group, member):  # every group's member 0: row 0 of L0.qkv, exponent + 1
        w = honest_load(src, plan, group, member)
        w.meta[0, 0] += 1
        return w

    monkeypatch.setattr(worker, "load_member", coalition)
    with MaskedEngine(tiny_qwen2, opts(verify=False)) as eng:
        eng.reset()
        lied = eng.forward(ids, all_logits=True)
    assert (lied - clean).abs().max() > 1e-3  # the lie is real: one of q's rows halved
    with pytest.raises(ModelError, match="client's own copy"):
        with MaskedEngine(tiny_qwen2, opts()) as eng:
            eng.reset()
            eng.forward(ids)
