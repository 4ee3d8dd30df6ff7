"""Masked mode: sessions and mask freshness, the audit's rules and their negative controls, the CLI's
flags (its parity with transformers: test_parity.py). The members are threads of this process
(tests/inproc.py, `--executor inproc`: the real members over the real links), but for the leak of A
to B, a control that patches a member's process."""

from __future__ import annotations

import json

import pytest
import torch
from chance import chance_hits_bound
from inproc import masked_threads

from fusion_compute.masked import attack, audit
from fusion_compute.masked.client import MaskedEngine, MaskedOptions
from fusion_compute.masked.masks import MaskReuseError
from fusion_compute.weights.loader import open_weights


def test_sessions_are_isolated_and_masks_never_reused(tiny_qwen2):
    with MaskedEngine(tiny_qwen2, masked_threads(n_a=1, n_b=1, timeout_s=60, context=64)) as eng:
        eng.reset()
        a = eng.forward([1, 2, 3], all_logits=True)
        eng.reset()
        eng.forward([9, 9, 9, 9, 9])
        eng.reset()
        b = eng.forward([1, 2, 3], all_logits=True)
        assert torch.equal(a, b)  # same logits from a fresh session (new key, new masks)
        eng.step = 0  # a client bug that would replay step 0's masks: refused before anything is sent
        with pytest.raises(MaskReuseError):
            eng.forward([4])


def _audited_run(path, tmp_path, sizes=(2, 1), **kw):
    d = tmp_path / "audit"
    ids = [7, 7, 7, 7, 7, 7, 7, 7, 30, 31]  # repeated tokens: identical clear inputs, the worst case
    # members as threads (tests/inproc.py), but for a leak: a control that patches a member's process
    options = MaskedOptions if "leak" in kw else masked_threads
    opts = options(n_a=sizes[0], n_b=tuple(sizes[1:]), timeout_s=60, context=64, audit_dir=str(d), **kw)
    with MaskedEngine(path, opts) as eng:
        eng.reset()
        eng.forward(ids)
        for t in (3, 4, 5):
            eng.forward([t])
        eng.reset()
        eng.forward(ids[:4])
    return d, ids


@pytest.fixture(scope="module")
def k2_run(tiny_qwen2, tmp_path_factory):
    """One audited run of 1+1+1 (k = 2) for the tests that read it, each as its own run was (a test
    that alters the logs alters a copy), and the session keys its client drew, in order."""
    from fusion_compute.masked import client as masked_client

    keys: list[bytes] = []
    real = masked_client.new_key
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(masked_client, "new_key", lambda: keys.append(real()) or keys[-1])
        d, ids = _audited_run(tiny_qwen2, tmp_path_factory.mktemp("masked-k2"), (1, 1, 1))
    return d, ids, keys


@pytest.mark.parametrize("sizes", [(2, 1), (1, 1, 1), (1, 1, 1, 1)], ids=["k=1", "k=2", "k=3"])
def test_audit_passes_and_the_view_reveals_nothing(tiny_qwen2, tmp_path, sizes, request):
    """k mask groups: A's view is uniform and fresh, every mask group sees keys only, the attack
    recovers no more than chance; every product was checked."""
    d, ids = request.getfixturevalue("k2_run")[:2] if sizes == (1, 1, 1) else _audited_run(tiny_qwen2, tmp_path, sizes)
    report = audit.verify(d)
    assert report["ok"], report["violations"]
    a1 = report["parties"]["rank1"]
    assert set(a1["received"]) == {"control@0", "masked@0"} and set(a1["sent"]) <= {"control@0", "meta@0", "ring_out@0"}
    for rank in range(sizes[0] + 1, sum(sizes) + 1):  # every member of every mask group: keys, never data
        assert set(report["parties"][f"rank{rank}"]["received"]) == {"control@0", "key@0"}, rank
    v = report["verification"]
    assert v["on"] and v["failed"] == 0 and not v["detections"] and v["products_checked"] == 5 * 4 * 3  # 5 steps
    assert a1["uniformity"]["ok"] and a1["freshness"]["across_steps"]["pairs"] > 0
    # The attack on exactly what worker 1 received: its first message is layer 0's qkv input.
    op, first = audit.read_tap(d, 1)[0]
    assert op == "L0.qkv" and first.shape[1] == len(ids)
    guesses = attack.vocab_match(torch.from_numpy(first.T.copy()), attack.masked_table(open_weights(tiny_qwen2)))
    assert attack.recovered(guesses, ids) <= chance_hits_bound(
        ids, open_weights(tiny_qwen2).config.vocab
    )  # tests/chance.py


def test_audit_negative_control_no_masks(tiny_qwen2, tmp_path):
    """Masks off: results stay exact, but A's view fails the audit and the attack reads the prompt.
    Both of rule 5's statistics fail on both members of A, by far, and nothing else does: the view is
    what changed, not the traffic's shape or the product checks."""
    d, ids = _audited_run(tiny_qwen2, tmp_path, masks="zero")
    report = audit.verify(d)
    assert not report["ok"]
    for rank in (1, 2):
        a = report["parties"][f"rank{rank}"]
        uni, fresh = a["uniformity"], a["freshness"]
        assert not uni["ok"] and uni["max_deviation"] > 10 * uni["limit"], uni  # clear fixed point: biased bits
        for name in ("within", "across_steps"):  # neighbouring clear values are close, not 2^-7 of the time
            assert fresh[name]["pairs"] > 0 and fresh[name]["close_fraction"] > 0.5 > fresh[name]["limit"], fresh
        assert f"rank {rank} (A): received data is not uniform" in " ".join(report["violations"])
        assert f"rank {rank} (A): masks not fresh within" in " ".join(report["violations"])
        assert f"rank {rank} (A): masks not fresh across_steps" in " ".join(report["violations"])
    # and its any-pair check, once per member of A: clear values crowd a few buckets (far from uniform)
    assert [v for v in report["violations"] if "any_pair" in v] == [
        f"participant {p} (A; rank {r}): masks not fresh any_pair: {report['a_views'][f'participant{p}']['note']}"
        for r, p in ((1, report["epochs"][0]["order"][0]), (2, report["epochs"][0]["order"][1]))
    ], report["violations"]
    assert len(report["violations"]) == 8, report["violations"]  # rule 5 only
    assert report["verification"]["failed"] == 0 and report["verification"]["products_checked"] == 5 * 4 * 3
    op, first = audit.read_tap(d, 1)[0]
    guesses = attack.vocab_match(torch.from_numpy(first.T.copy()), attack.masked_table(open_weights(tiny_qwen2)))
    assert attack.recovered(guesses, ids) == len(ids)


def test_audit_negative_control_unchecked_products(k2_run, tmp_path):
    """The client's check records are the evidence that every product was verified: drop some and
    the audit fails (rule 6); the CLI verifier says so with exit 1."""
    import shutil

    from fusion_compute.cli.main import main

    d = shutil.copytree(k2_run[0], tmp_path / "audit")  # altered below: the shared run stays as it was
    assert main(["audit", "verify", str(d)]) == 0
    log = audit.log_path(d, 0)
    lines = log.read_text().splitlines()
    kept = [x for x in lines if not ('"type":"check"' in x and '"layer":1' in x)]
    assert len(kept) < len(lines)
    log.write_text("\n".join(kept) + "\n")
    report = audit.verify(d)
    assert not report["ok"] and any("never checked" in v for v in report["violations"]), report["violations"]
    assert main(["audit", "verify", str(d)]) == 1
    # A tap cut short (its log indexes bytes the file lacks): a clear error, not a numpy traceback.
    tap = audit.tap_path(d, 1)
    tap.write_bytes(tap.read_bytes()[:-8])
    with pytest.raises(audit.MaskedAuditError, match="past the tap's end"):
        audit.verify(d)
    assert main(["audit", "verify", str(d)]) == 2


def test_audit_negative_controls_reused_keys_labels_and_masks(tiny_qwen2, tmp_path, monkeypatch):
    """Rule 4 and rule 5's freshness, each produced: a client whose key source repeats itself (every
    session gets the same key: a real run, its masks still uniform and fresh per label) fails rule 4
    on the key and rule 5's any-pair check on what each member of A received (the second session's
    step reuses the first session's pads, label for label); a copy of its log with one mask label
    drawn twice adds that violation; a copy of its A tap where each op's messages repeat the
    previous one's ring elements (uniform words still) adds the across-steps freshness violation,
    with the uniformity test still passing."""
    import shutil

    import numpy as np

    from fusion_compute.masked import client

    monkeypatch.setattr(client, "new_key", lambda: bytes(range(32)))  # the same key for every session
    d, _ = _audited_run(tiny_qwen2, tmp_path)
    base = audit.verify(d)
    # Before rule 5 compared every pair of a member's messages, this run failed on the key alone
    # (["a session key was reused"]): the reuse A sees, a pad under two sessions' plaintexts, was
    # invisible to its consecutive comparison. Now each member of A names it: the second session's
    # one step (messages 48..59: after 4 steps x 3 layers x 4 linears) reuses the first session's
    # first step (0..11), linear for linear, with other T (10 vs 4 columns) and other plaintexts.
    seated = base["epochs"][0]["order"]
    assert base["violations"][-1] == "a session key was reused", base["violations"]
    assert [v.split(":")[0] for v in base["violations"][:-1]] == [
        f"participant {seated[0]} (A; rank 1)",
        f"participant {seated[1]} (A; rank 2)",
    ], base["violations"]
    for who in seated[:2]:
        view = base["a_views"][f"participant{who}"]
        assert [p["messages"] for p in view["reused"]] == [[i, 48 + i] for i in range(12)], view
        assert all(p["close_fraction"] == 1.0 for p in view["reused"]), view

    labels = tmp_path / "labels"
    shutil.copytree(d, labels)
    log = audit.log_path(labels, 0)
    lines = log.read_text().splitlines()
    first_mask = next(i for i, x in enumerate(lines) if '"type":"mask"' in x.replace(" ", ""))
    lines.insert(first_mask + 1, lines[first_mask])
    log.write_text("\n".join(lines) + "\n")
    assert audit.verify(labels)["violations"] == [
        *base["violations"][:-1],
        f"mask labels reused: 1 of {5 * 4 * 3 + 1}",
        base["violations"][-1],
    ]

    pads = tmp_path / "pads"
    shutil.copytree(d, pads)
    tap = bytearray(audit.tap_path(pads, 1).read_bytes())
    previous: dict[str, np.ndarray] = {}
    reused = set()
    for rec in audit.read_log(pads, 1):
        if rec["type"] != "tap":
            continue
        k, t = rec["shape"]
        here = np.frombuffer(tap, dtype="<i8", count=k * t, offset=rec["offset"]).reshape(k, t)
        prev = previous.get(rec["op"])
        if prev is not None and rec["op"] not in reused:  # once per op (more repeats bias the byte counts)
            here[:, :] = prev[:, :t]  # this message carries the previous one's words: its pad was reused
            reused.add(rec["op"])
        previous[rec["op"]] = here.copy()
    assert len(reused) == 4 * 3  # every linear of every layer, once
    audit.tap_path(pads, 1).write_bytes(bytes(tap))
    report = audit.verify(pads)
    a1 = report["parties"]["rank1"]
    assert a1["uniformity"]["ok"] and a1["freshness"]["within"]["ok"], a1  # the words alone look uniform
    assert not a1["freshness"]["across_steps"]["ok"], a1["freshness"]
    assert report["violations"][1:] == base["violations"] and report["violations"][0].startswith(
        "rank 1 (A): masks not fresh across_steps"
    ), report["violations"]


def test_audit_negative_control_a_talks_to_b(tiny_qwen2, tmp_path):
    d, _ = _audited_run(tiny_qwen2, tmp_path, leak="a-to-b")
    report = audit.verify(d)
    assert not report["ok"]
    assert any("rank 1 (A)" in v and "worker(s) [3]" in v for v in report["violations"]), report["violations"]
    assert any("rank 3 (B) received leak" in v for v in report["violations"]), report["violations"]


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """`fusion ...` in this process (bad flags never spawn; the good run spawns its workers)."""
    from fusion_compute.cli.main import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_k_groups_audited_and_verified(tiny_qwen2, tmp_path, capsys):
    d = tmp_path / "aud"
    code, out, err = _cli(
        capsys,
        "generate",
        "--model",
        str(tiny_qwen2),
        "--mode",
        "masked",
        "--workers",
        "1+1+1",
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "3",
        "--json",
        "--executor",
        "inproc",
        "--audit-dir",
        str(d),
    )
    assert code == 0, err
    # off a terminal, the masked start-up log in timestamped lines: each worker's group and member
    assert "fusion generate: masked plan " in err and "): group B2 member 0, weight rows" in err, err
    j = json.loads(out)
    assert j["groups"] == [1, 1, 1] and j["verified"]["failed"] == 0 and j["verified"]["token_checks"] == (3 + 2) * 12
    code, out, err = _cli(capsys, "audit", "verify", str(d))
    assert code == 0, err
    assert "PASS" in out and "groups 1+1+1" in out and "60 token columns), 0 failed" in out


def test_cli_flags(tiny_qwen2, capsys):
    code, out, err = _cli(
        capsys,
        "generate",
        "--model",
        str(tiny_qwen2),
        "--mode",
        "masked",
        "--workers",
        "1+2",
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "3",
        "--json",
        "--executor",
        "inproc",
    )
    assert code == 0, err
    assert '"mode": "masked"' in out and '"groups": [1, 2]' in out
    bad = [
        (("--workers", "2+2"), "needs --mode masked"),  # groups without the mode
        (("--mode", "masked", "--workers", "3"), "group sizes A+B"),
        (("--mode", "masked", "--workers", "0+2"), "at least one worker in each group"),
        (("--mode", "masked", "--workers", "2+2", "--capacity", "2,1"), "not supported with --mode masked"),
        (("--mode", "masked", "--workers", "2+2+0"), "at least one worker in each group"),
        (("--workers", "3", "--audit-dir", "x"), "--audit-dir is for --mode masked"),
    ]
    for flags, msg in bad:
        code, _, err = _cli(capsys, "generate", "--model", str(tiny_qwen2), "--prompt-ids", "1,2", *flags)
        assert code != 0 and msg in err, (flags, err)
        assert len(err.strip().splitlines()) == 1, err


def test_a_coalition_short_of_one_mask_group_learns_nothing(tiny_qwen2, k2_run):
    """k = 2 (1+1+1): A colluding with B1 (its key) removes r_1 from what A received and still faces
    x + r_2, uniform: the vocabulary attack recovers no more than chance. With B2's key as well, the
    same attack reads every prompt token (the control that the attack and the keys are right)."""
    from fusion_compute.masked.masks import MaskStream

    d, ids, keys = k2_run
    op, first = audit.read_tap(d, 1)[0]  # session 1's prefill, layer 0's qkv input: x_fx + r_1 + r_2
    assert op == "L0.qkv"
    m = torch.from_numpy(first.copy())  # (K, T) int64: the ring's wrap-around is int64's
    k1, k2 = keys[0], keys[1]  # the first session's keys of B1 and B2
    r1, r2 = (MaskStream(k, guard=False).draw(0, 0, 0, m.numel()).view(m.shape) for k in (k1, k2))
    table = attack.masked_table(open_weights(tiny_qwen2))
    short = attack.recovered(attack.vocab_match((m - r1).T.contiguous(), table), ids)
    whole = attack.recovered(attack.vocab_match((m - r1 - r2).T.contiguous(), table), ids)
    assert short <= chance_hits_bound(ids, open_weights(tiny_qwen2).config.vocab) and whole == len(ids), (
        short,
        whole,
    )  # tests/chance.py
