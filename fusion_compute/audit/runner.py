"""The experiment runner: `fusion audit run --workers N --steps 250 --cold-starts 5 --out DIR`.

Each cold start is fresh processes: a client (this process, rank 0) and N spawned workers (plus
standbys), each recording its own hash-chained log of every plan epoch into OUT/coldK/epoch{E}/.
One session, through `generate()` (StepHooks record each step): a prefill of the prompt, then
`steps` decode steps with greedy sampling and forced continuation (EOS does not stop it, so every
decode step really runs), its slot released at the end. With `speculative` (a SpeculativeConfig)
the same loop speculates: `steps` is then the number of tokens generated after the first (the same
tokens as without speculation), in fewer forwards, some of them verifications of K + 1 columns whose
rejected columns are rolled back; the client's log records each rollback where the workers' do
(_Rollbacks). With `revoke_at` the runner
revokes a worker before that decode step, as a user would (`engine.revoke`): the session moves to
epoch 1 (a standby in its seat), whose first step is the replay of the session's tokens, recorded
like any step. Around each epoch's steps, and at the revocation, the runner samples the kernel's
per-socket byte counters of the worker processes (netcount.py). Then it writes each epoch's
manifest, the membership record and the cold start's manifest, runs the independent verifier, and
finally OUT/summary.json and OUT/report.md across all cold starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..structural.protocol import MAX_SLOTS
from . import netcount
from . import schema as S
from .recorder import AuditRecorder, model_dims
from .verify import RunResult, verify_dir

if TYPE_CHECKING:  # types only: the run imports these lazily, after its arguments are checked
    from ..generation.speculative_config import SpeculativeConfig
    from ..model.config import ModelConfig
    from ..structural.plan import Plan
    from ..weights.source import WeightSource

DEFAULT_PROMPT = "The history of the printing press begins in"
FALLBACK_PROMPT_IDS = (5, 17, 33, 2, 99, 100, 7, 8)
# With speculation: a prompt that repeats itself, so that n-gram (prompt lookup) drafts are proposed
# from the first decode step, some accepted (the model continues the pattern) and some rejected
# (where it leaves it): the audit then sees verifications, rollbacks and accepted drafts.
SPECULATIVE_PROMPT = (
    "Copy the list exactly.\nList: 1. red apple 2. green pear 3. yellow lemon 4. purple plum 5. orange peach "
    "6. red cherry 7. green grape\nCopy: 1. red apple 2. green"
)
# Without a tokenizer (tiny random models, which tend to repeat one token, 99 for the test suite's
# Qwen2): a pair of that token followed by others draws drafts that are rejected at first, then, as
# the run of it grows, accepted.
FALLBACK_SPECULATIVE_IDS = (5, 17, 99, 99, 7, 8, 33, 2)


STALE_ROLLBACK = "stale-rollback"  # inject.py's control that ignores speculation's rollbacks
NO_ROLLBACK_TO_IGNORE = (
    f"--inject-leak {STALE_ROLLBACK} needs --speculative: without drafts there is no rollback to ignore"
)


class AuditRunError(RuntimeError):
    pass


@dataclass
class RunConfig:
    out: Path
    model: str | None = None
    workers: int = 2
    steps: int = 250
    cold_starts: int = 5
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    capacities: tuple[float, ...] | None = None
    inject_leak: str | None = None
    variant: str = "sharded"
    threads: int | None = None
    timeout_s: float = 120.0
    device: str = "cpu"  # the workers' (runtime/placement.py); the client's follows
    dtype: str = "float32"  # the workers' compute dtype, and the wire's (the manifest's wire_dtype)
    netcount: bool = True
    exposure: bool = True  # add the exposure ranks and the layer-0 vocabulary attack to the report
    revoke_at: int | None = None  # revoke a worker before this decode step (0-based): two epochs
    revoke_worker: int = 1  # the participant revoked
    standby: int | None = None  # local spares (default: 1 with revoke_at, else 0)
    negative_control: str | None = None  # "keep-revoked" (tests only): the client keeps the revoked worker
    batch: int = 1  # > 1: batch + 1 sessions share the workers' steps, `batch` KV slots (_run_batched)
    speculative: SpeculativeConfig | None = None  # speculative decoding

    @property
    def sessions(self) -> int:
        """Sessions per cold start: one, or batch + 1 (so that one slot is reused)."""
        return self.batch + 1 if self.batch > 1 else 1

    @property
    def spares(self) -> int:
        return self.standby if self.standby is not None else (1 if self.revoke_at is not None else 0)


def resolve_prompt(cfg: RunConfig, model_path: Path, vocab: int) -> tuple[list[int], str]:
    """Prompt ids and where they came from. Text goes through the model's tokenizer, on this (client)
    side only; models without one (tiny test models) fall back to fixed ids."""
    if cfg.prompt_ids:
        bad = [i for i in cfg.prompt_ids if not (0 <= i < vocab)]
        if bad:
            raise AuditRunError(f"prompt id {bad[0]} outside the vocabulary [0, {vocab})")
        return list(cfg.prompt_ids), "ids"
    text = cfg.prompt or (SPECULATIVE_PROMPT if cfg.speculative is not None else DEFAULT_PROMPT)
    try:
        from ..weights.tokenizer import load_tokenizer

        ids = load_tokenizer(model_path).encode(text)
        if ids:
            return ids, f"text: {text!r}"
    except Exception:
        if cfg.prompt:
            raise AuditRunError(f"cannot tokenize --prompt for {model_path}: use --prompt-ids") from None
    fixed = FALLBACK_SPECULATIVE_IDS if cfg.speculative is not None else FALLBACK_PROMPT_IDS
    return [i % vocab for i in fixed], "fixed ids (model has no tokenizer)"


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fusion-compute")
    except PackageNotFoundError:
        return "unknown"


def _final_hash(path: Path) -> str | None:
    last = None
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                last = line
    return json.loads(last)["hash"] if last else None


def _picture(d: Path, result) -> str | None:
    """The ownership map the verifier read in cold start `d` (verify/picture.py), written beside its
    directory as ownership-<cold start>.svg (the directory itself holds only what the manifest lists);
    its file name, or None when it could not be written."""
    from .verify.drawing import write_svg
    from .verify.picture import audit_pictures

    out = d.parent / f"ownership-{d.name}.svg"
    try:
        write_svg(audit_pictures(d, result), out)
    except OSError:
        return None
    return out.name


def _end_record(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            lines = [ln for ln in f if ln.strip()]
        rec = json.loads(lines[-1])
        return rec if rec.get("type") == "end" else {}
    except (OSError, IndexError, json.JSONDecodeError):
        return {}


@dataclass(frozen=True)
class Prepared:
    model_path: Path
    config: ModelConfig
    src: WeightSource  # the client's WeightSource, opened once and reused by every cold start's Engine
    prompt: list[int]
    prompt_src: str
    draft_model: object = None  # speculation's draft model (generation.speculative), loaded once per run


def prepare(cfg: RunConfig) -> Prepared:
    """Resolve the model and the prompt once per run (opening a GGUF takes seconds)."""
    from ..weights.loader import open_weights, resolve_model_path

    if cfg.workers < 1:
        raise AuditRunError(f"--workers must be >= 1, got {cfg.workers}")
    if cfg.steps < 1:
        raise AuditRunError(f"--steps must be >= 1, got {cfg.steps}")
    if cfg.cold_starts < 1:
        raise AuditRunError(f"--cold-starts must be >= 1, got {cfg.cold_starts}")
    if cfg.variant not in ("sharded", "megatron"):
        raise AuditRunError(f"--variant must be sharded or megatron, got {cfg.variant!r}")
    if cfg.spares < 0:
        raise AuditRunError(f"--standby must be >= 0, got {cfg.spares}")
    if cfg.negative_control not in (None, "keep-revoked"):
        raise AuditRunError(f"--negative-control must be keep-revoked, got {cfg.negative_control!r}")
    if cfg.negative_control and cfg.revoke_at is None:
        raise AuditRunError("--negative-control keep-revoked needs --revoke-at STEP")
    if not 1 <= cfg.batch <= MAX_SLOTS:
        raise AuditRunError(f"--batch must be in 1..{MAX_SLOTS}, got {cfg.batch}")
    if cfg.batch > 1 and cfg.revoke_at is not None:
        raise AuditRunError("--batch and --revoke-at cannot be combined (a revocation is audited on one session)")
    if cfg.speculative is not None and cfg.revoke_at is not None:
        raise AuditRunError("--speculative and --revoke-at cannot be combined (a revocation is audited without drafts)")
    if cfg.speculative is None and (cfg.inject_leak or "").strip() == STALE_ROLLBACK:
        raise AuditRunError(NO_ROLLBACK_TO_IGNORE)
    if cfg.revoke_at is not None:
        if not (0 <= cfg.revoke_at < cfg.steps):
            raise AuditRunError(f"--revoke-at must be in 0..{cfg.steps - 1} (a decode step), got {cfg.revoke_at}")
        if not (1 <= cfg.revoke_worker <= cfg.workers):
            raise AuditRunError(f"the revoked worker must be in 1..{cfg.workers}, got {cfg.revoke_worker}")
        if cfg.workers - 1 + min(cfg.spares, 1) < 2 and not cfg.negative_control:
            raise AuditRunError(
                f"revoking one of {cfg.workers} workers without a standby leaves fewer than 2: "
                "use --standby 1 or more workers"
            )
    model_path = resolve_model_path(cfg.model)
    src = open_weights(model_path)
    config = src.config
    if cfg.inject_leak:
        from .inject import parse_leak

        parse_leak(cfg.inject_leak, config.n_layers)
    from ..structural.plan import make_plan

    make_plan(config, cfg.workers, cfg.capacities)  # fail here, with the plan's message, not in a worker
    prompt, prompt_src = resolve_prompt(cfg, model_path, config.vocab)
    if len(prompt) + cfg.steps + 1 > config.max_positions:
        raise AuditRunError(
            f"prompt {len(prompt)} + {cfg.steps} steps exceed the model's window {config.max_positions}"
        )
    draft = speculator(cfg, config, prompt).model if cfg.speculative is not None else None
    return Prepared(model_path, config, src, prompt, prompt_src, draft)


def speculator(cfg: RunConfig, config, prompt: list[int], draft_model=None):
    """A cold start's speculative.Speculator (its counters are that cold start's): the draft model
    loaded and its vocabulary checked once, in prepare(), before any worker starts."""
    from ..generation.speculative import Speculator

    if cfg.speculative is None:  # the callers ask only when the run speculates
        raise AuditRunError("a speculator was asked for a run without --speculative")
    return Speculator(cfg.speculative, config.vocab, len(prompt) + cfg.steps + 1, draft_model=draft_model)


class _Rollbacks:
    """The client's record of speculation's rollbacks. The engine rolls a slot back without a message
    (engine.rollback): the workers see the slot's next span start below what they hold, zero the
    rejected positions and record a rollback just before that step. The client records the same
    rollback at the same place (before the step's record), from the spans it sends, so the verifier
    can hold every worker's rollbacks to the client's."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}  # slot -> positions its session holds
        self.count = 0

    def before(self, rec: AuditRecorder, spans: list[tuple[int, int, int]]) -> None:
        for slot, pos, t in spans:
            held = self.held.get(slot, 0)
            if 0 < pos < held:
                rec.rollback(slot, held, pos)
                self.count += 1
            self.held[slot] = pos + t

    def released(self, slot: int) -> None:
        self.held.pop(slot, None)


class _Sockets:
    """The kernel's socket counters of every local worker process (standbys included), sampled
    between steps while the workers are idle. Pulse connections are left out: every one the watch
    has had, so a departed worker's closed pulse is never counted as data."""

    def __init__(self, engine, enabled: bool):
        self.engine = engine
        self.on = enabled
        self.pulse: frozenset[str] = frozenset()
        self.samples: list[netcount.Sample] = []

    def take(self) -> int | None:
        """Sample now; the sample's index (None when not measuring)."""
        if not self.on:
            return None
        netcount.settle()
        self.pulse |= self.engine.watch.endpoints()
        self.samples.append(netcount.sample(self.engine.procs.pids, self.pulse))
        return len(self.samples) - 1

    def moved(self, i: int | None, j: int | None) -> dict[int, dict[str, int]]:
        """Per process, the bytes between samples i and j (<= j - i consecutive deltas, so sockets
        opened after i count from zero as long as they are alive at some sample up to j)."""
        out: dict[int, dict[str, int]] = {}
        if i is None or j is None:
            return out
        for a in range(i, j):
            for pid, m in netcount.delta(self.samples[a], self.samples[a + 1]).items():
                acc = out.setdefault(pid, {"sent": 0, "retrans": 0, "received": 0, "sockets": 0})
                for k in ("sent", "retrans", "received"):
                    acc[k] += m[k]
                acc["sockets"] = m["sockets"]  # at the last sample
        return out


@dataclass
class _Epoch:
    """One plan epoch of a cold start, as the runner saw it."""

    index: int
    rec: AuditRecorder  # the client's log of the epoch
    order: list[int]  # participants in rank order
    plan: Plan
    before: int | None = None  # sample indices (_Sockets)
    after: int | None = None
    left: list[dict] | None = None  # who left before it, and why
    replayed_tokens: int = 0


def _open_client_log(cfg: RunConfig, engine, ep: _Epoch) -> None:
    """The header of the client's log of an epoch: the ingress / egress maps of its plan (ingress: a
    worker's residual shard; egress: every residual coordinate, the last layer's down partial with the
    worker's own rows added, which the client sums)."""
    ingress = {str(s.rank): S.to_runs(range(*s.residual)) for s in ep.plan.workers}
    egress = {str(s.rank): S.to_runs(range(engine.config.hidden)) for s in ep.plan.workers}
    ep.rec.start(None, engine.config, variant=cfg.variant, leak=cfg.inject_leak, ingress=ingress, egress=egress)


def _revoke(cfg: RunConfig, engine, d: Path, ep: _Epoch, sockets: _Sockets) -> _Epoch:
    """Revoke `cfg.revoke_worker` as a user would, between two steps; the next epoch is opened (a
    standby in its seat) and its client log started. The caller replays the session inside a
    recorded step."""
    index = ep.index + 1
    rec = AuditRecorder.for_epoch(d, index, 0, role="client")
    engine.recorder = rec  # _open_epoch hands it to the new epoch's links
    n_recoveries = len(engine.recoveries)
    try:
        engine.revoke(cfg.revoke_worker, replay=False)
    except BaseException:
        rec.close()
        raise
    ep.rec.close()
    if engine.epoch != index or len(engine.recoveries) != n_recoveries + 1:
        raise AuditRunError(f"revoking worker {cfg.revoke_worker} did not open epoch {index}")
    change = engine.recoveries[-1]
    why = S.REVOKED if change.get("revoked") else S.LOST
    nxt = _Epoch(index, rec, list(engine.order), engine.plan)
    nxt.left = [{"participant": p, "why": why, "reason": change.get("reason")} for p in change["lost"]]
    nxt.replayed_tokens = len(engine.history)
    _open_client_log(cfg, engine, nxt)
    nxt.before = sockets.take()
    return nxt


def _no_recovery(engine, epochs: list[_Epoch]) -> None:
    if len(engine.recoveries) != len(epochs) - 1:
        raise AuditRunError(
            "a worker was lost during the audited run; the runner audits epochs opened by a revocation, not by recovery"
        )


def _run_batched(
    cfg: RunConfig, engine, rec: AuditRecorder, prompt: list[int], epochs: list[_Epoch], spec, rollbacks: _Rollbacks
):
    """`cfg.batch` + 1 sessions on `cfg.batch` KV slots, as continuous batching runs them: session i
    joins at step i (its prefill next to the others' decodes), runs `cfg.steps` greedy decode steps
    (forced continuation) and leaves, its slot released; the last one takes the first freed slot.
    Session i's prompt is the first len(prompt) - i tokens, so the sessions differ. Every step and
    release is recorded with its spans, and every rollback (`spec`: a speculative.Speculator or None).
    Returns each session's tokens, the first step's time and the time of the rest."""
    from ..generation.batching import BatchRunner, Sequence, StepHooks
    from ..generation.sampling_params import SamplingParams

    prompts = [prompt[: max(1, len(prompt) - i)] for i in range(cfg.sessions)]
    at = {"steps": 0, "ttft": 0.0, "t0": time.perf_counter()}

    def before(spans: list[tuple[int, int, int]]) -> None:
        if at["steps"] == 0:  # the session record follows the RESET of the first admission
            rec.new_session()
        rollbacks.before(rec, spans)
        rec.begin_step(sum(n for _, _, n in spans), spans[0][1], [list(sp) for sp in spans])

    def after() -> None:
        rec.end_step()
        _no_recovery(engine, epochs)
        if at["steps"] == 0:
            at["ttft"], at["t0"] = time.perf_counter() - at["t0"], time.perf_counter()
        at["steps"] += 1

    # the loop of `fusion serve --max-batch` and generate(), session i admitted at step i (or when
    # none runs); forced continuation: no stop ids, every session runs cfg.steps decode steps
    # (with speculation: generates cfg.steps tokens after its first, in fewer steps)
    def released(slot: int) -> None:
        rec.release(slot)
        rollbacks.released(slot)

    runner = BatchRunner(engine, cfg.batch, StepHooks(before, after, released), spec)
    seqs = [Sequence(p, cfg.steps + 1, SamplingParams()) for p in prompts]
    waiting = list(range(cfg.sessions))
    while waiting or runner.active:
        if waiting and runner.room and (waiting[0] <= at["steps"] or not runner.active):
            runner.add(seqs[waiting.pop(0)])
        runner.step()
    return [s.out for s in seqs], at["ttft"], time.perf_counter() - at["t0"]


def run_cold_start(cfg: RunConfig, index: int, prep: Prepared | None = None) -> dict:
    import torch

    from ..generation.batching import StepHooks
    from ..generation.generate import generate
    from ..generation.sampling_params import SamplingParams
    from ..structural.client import Engine, EngineOptions

    d = cfg.out / f"cold{index}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    rec0 = AuditRecorder.for_epoch(d, 0, 0, role="client")
    extra = ["--audit-dir", str(d.resolve())]
    if cfg.inject_leak:
        extra += ["--inject-leak", cfg.inject_leak]
    if cfg.variant != "sharded":
        extra += ["--variant", cfg.variant]
    started = time.time()
    t0 = time.perf_counter()
    opts = EngineOptions(
        n_workers=cfg.workers,
        capacities=cfg.capacities,
        context=None,
        threads=cfg.threads,
        timeout_s=cfg.timeout_s,
        extra_worker_args=tuple(extra),
        standby=cfg.spares,
        device=cfg.device,
        dtype=cfg.dtype,
    )
    prep = prep or prepare(cfg)
    model_path, prompt, prompt_src = prep.model_path, prep.prompt, prep.prompt_src
    opts.context = len(prompt) + cfg.steps + 1  # KV shards sized to the session, not the 4096 default
    engine = Engine(model_path, opts, recorder=rec0, source=prep.src)
    if cfg.negative_control == "keep-revoked":
        from .inject import keep_revoked

        keep_revoked(engine)
    tokens: list[int] = []
    ep = _Epoch(0, rec0, list(engine.order), engine.plan)
    epochs = [ep]
    sockets = _Sockets(engine, cfg.netcount and engine.procs is not None and netcount.available())
    replay_ok = None
    spec = None if cfg.speculative is None else speculator(cfg, prep.config, prompt, prep.draft_model)
    rollbacks = _Rollbacks()
    try:
        _open_client_log(cfg, engine, ep)
        load_s = time.perf_counter() - t0
        ep.before = sockets.take()
        replay_s, decode_tokens = 0.0, cfg.steps
        if cfg.batch > 1:
            sessions, ttft, decode_s = _run_batched(cfg, engine, ep.rec, prompt, epochs, spec, rollbacks)
            tokens = [t for out in sessions for t in out]
            decode_tokens = len(tokens) - 1  # every token after the first step's
        else:
            at = {"t1": 0.0, "t2": 0.0, "steps": 0}

            def before(spans: list[tuple[int, int, int]]) -> None:
                ((_, pos, t),) = spans
                if at["steps"] == 0:  # the session's record follows the RESET the loop sent
                    ep.rec.new_session()
                    at["t1"] = time.perf_counter()
                rollbacks.before(ep.rec, spans)
                ep.rec.begin_step(t, pos)

            def after() -> None:
                ep.rec.end_step()
                at["steps"] += 1

            def on_token(tok: int) -> None:
                nonlocal ep, ttft, replay_s, replay_ok
                tokens.append(tok)
                if len(tokens) == 1:
                    ttft = time.perf_counter() - at["t1"]
                _no_recovery(engine, epochs)
                if len(tokens) == 1:
                    at["t2"] = time.perf_counter()
                if len(tokens) - 1 == cfg.revoke_at and len(tokens) <= cfg.steps:  # before decode step revoke_at
                    t3 = time.perf_counter()
                    ep.after = sockets.take()
                    if ep.after is None:
                        netcount.settle()  # every worker has written its last step's record
                    ep = _revoke(cfg, engine, d, ep, sockets)
                    epochs.append(ep)
                    history = list(engine.history)
                    engine.reset()
                    ep.rec.new_session()
                    ep.rec.begin_step(len(history), 0)  # the replay: the new epoch's first step
                    logits = engine.forward(history)
                    ep.rec.end_step()
                    replay_ok = int(torch.argmax(logits)) == tokens[-1]  # exact: the same next token
                    replay_s = time.perf_counter() - t3

            def released(slot: int) -> None:
                ep.rec.release(slot)
                rollbacks.released(slot)

            # forced continuation (no stop ids): EOS does not stop an audit run; with speculation the
            # same cfg.steps + 1 tokens, in fewer steps
            ttft = 0.0
            generate(
                engine,
                prompt,
                max_new_tokens=cfg.steps + 1,
                sampling=SamplingParams(),
                on_token=on_token,
                hooks=StepHooks(before, after, released),
                speculator=spec,
            )
            decode_s = time.perf_counter() - at["t2"] - replay_s
        ep.after = sockets.take()
    finally:
        engine.close()
        for e in epochs:
            e.rec.close()
    ended = time.time()
    pid_of = {p + 1: pid for p, pid in enumerate(engine.procs.pids)} if engine.procs is not None else {}
    entries = []
    for e in epochs:
        sub = d / S.epoch_dir(e.index)
        net = None
        if sockets.on:
            moved = sockets.moved(e.before, e.after)
            net = {
                "tool": "ss -tinpH (kernel tcp_info bytes_sent / bytes_received per socket)",
                "interval": "after the epoch's HELLO handshake, until its last step: the session and its steps",
                "excluded": "each worker's pulse connection (heartbeats: no state; their count depends on time)",
                "ranks": {
                    str(r): {"pid": pid_of[p], "participant": p, **moved.get(pid_of[p], {})}
                    for r, p in enumerate(e.order, 1)
                },
            }
            (sub / S.NETCOUNT).write_text(json.dumps(net, indent=2))
        chains = {}
        for rank in range(len(e.order) + 1):
            p = sub / S.log_name(rank)
            chains[str(rank)] = _final_hash(p) if p.is_file() else None
        manifest = {
            "schema": S.SCHEMA_VERSION,
            "epoch": e.index,
            "order": e.order,
            "model": {"path": str(model_path), "dims": model_dims(engine.config)},
            "workers": len(e.order),
            "capacities": [engine.seats[p].capacity for p in e.order],
            "variant": cfg.variant,
            "inject_leak": cfg.inject_leak,
            "plan": e.plan.to_dict(),
            "plan_fingerprint": e.plan.fingerprint(),
            "wire": engine.opts.comm_backend,  # the verifier's wire model for the socket byte check
            "wire_dtype": engine.opts.dtype,  # the state's dtype on the wire: its bytes per element
            "chains": chains,
            "netcount_sha256": hashlib.sha256((sub / S.NETCOUNT).read_bytes()).hexdigest() if net else None,
        }
        (sub / S.MANIFEST).write_text(json.dumps(manifest, indent=2))
        entries.append(
            {
                "epoch": e.index,
                "dir": S.epoch_dir(e.index),
                "manifest_sha256": hashlib.sha256((sub / S.MANIFEST).read_bytes()).hexdigest(),
            }
        )
    membership = {
        "by": "the client (this runner): each epoch's participants in rank order, who left before it and why",
        "epochs": [
            {"epoch": e.index, "order": e.order, "left": e.left or [], "replayed_tokens": e.replayed_tokens}
            for e in epochs
        ],
    }
    (d / S.MEMBERSHIP).write_text(json.dumps(membership, indent=2))
    run_net = None
    if sockets.on and len(epochs) > 1:
        departed: dict[str, dict[str, int]] = {}  # participant -> its pid and bytes moved
        for e in epochs[1:]:
            for x in e.left or []:
                pid = pid_of[x["participant"]]
                its_bytes = sockets.moved(epochs[e.index - 1].after, epochs[-1].after).get(pid, {})
                departed[str(x["participant"])] = {"os_pid": pid, **its_bytes}
        run_net = {
            "tool": "ss -tinpH (kernel tcp_info bytes_sent / bytes_received per socket)",
            "interval": "from the sample just before the worker left (revocation) to the last step, summed over "
            "every sample in between; a process that exited has no sockets and counts 0",
            "excluded": "every pulse connection the client has watched",
            "departed": departed,
        }
        (d / S.NETCOUNT).write_text(json.dumps(run_net, indent=2))
    manifest = {
        "schema": S.SCHEMA_VERSION,
        "kind": "cold start",
        "model": {"path": str(model_path), "dims": model_dims(engine.config)},
        "workers": cfg.workers,
        "standby": cfg.spares,
        "capacities": list(cfg.capacities) if cfg.capacities else None,
        "variant": cfg.variant,
        "inject_leak": cfg.inject_leak,
        "negative_control": cfg.negative_control,
        "prompt": {"tokens": len(prompt), "source": prompt_src},
        "steps": {"prefill": 1, "decode": cfg.steps, "replays": len(epochs) - 1},  # per session
        "batch": {"slots": cfg.batch, "sessions": cfg.sessions} if cfg.batch > 1 else None,
        "speculative": None if cfg.speculative is None else cfg.speculative.describe(),
        "revoke": {"worker": cfg.revoke_worker, "before_decode_step": cfg.revoke_at}
        if cfg.revoke_at is not None
        else None,
        "versions": {
            "fusion_compute": _package_version(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "started": started,
        "ended": ended,
        "epochs": entries,
        "membership_sha256": hashlib.sha256((d / S.MEMBERSHIP).read_bytes()).hexdigest(),
        "netcount_sha256": hashlib.sha256((d / S.NETCOUNT).read_bytes()).hexdigest() if run_net else None,
    }
    (d / S.MANIFEST).write_text(json.dumps(manifest, indent=2))
    result = verify_dir(d)
    if not isinstance(result, RunResult):  # the manifest written above lists the epochs: a cold start
        raise AuditRunError(f"{d}: verified as one epoch, not as the cold start this run wrote")
    picture = _picture(d, result)
    busy = {}
    for e in epochs:
        for rank in range(len(e.order) + 1):
            end = _end_record(d / S.epoch_dir(e.index) / S.log_name(rank))
            if end and end.get("steps"):
                key = str(rank) if len(epochs) == 1 else f"e{e.index}.{rank}"
                busy[key] = round(1000 * end["recorder_busy_s"] / end["steps"], 4)
    return {
        "cold_start": index,
        "dir": str(d),
        "ok": result.ok,
        "picture": picture,
        "summary": result.summary_line(),
        "decode_steps": result.decode_steps,
        "closed_decode": result.closed_decode,
        "verify_steps": result.verify_steps,
        "closed_verify": result.closed_verify,
        "batched_sessions": result.batched_sessions,
        "closed_sessions": result.closed_sessions,
        "prefill_steps": result.prefill_steps,
        "closed_prefill": result.closed_steps - result.closed_decode - result.closed_verify,
        "forwards": result.steps,  # sharded forwards (steps), every one audited
        "generated_tokens": len(tokens),  # what they produced: > forwards when drafts were accepted
        "speculative": None if spec is None else spec.totals.as_dict() | {"rollbacks": rollbacks.count},
        "layers": result.layers,
        "layer_closed": result.layer_closed,
        "violation_counts": result.counts(),
        "first_violations": [f"{v.invariant} [{v.where()}]: {v.message}" for v in result.violations[:5]],
        "checks": result.checks,
        "coalition": result.coalition,
        "bytes_per_step": result.bytes_per_step,
        "os": result.os,
        "epochs": [
            {
                "epoch": e.index,
                "order": e.order,
                "ok": r.ok,
                "summary": r.summary_line(),
                "violation_counts": r.counts(),
                "os": r.os,
                "notes": r.notes,
            }
            for e, r in zip(epochs, result.epochs, strict=False)
        ],
        "membership": {
            "ok": not result.counts()["membership"],
            "checked": result.checks["membership"],
            "departures": result.departures,
            "replays": result.replays,
            "notes": result.notes,
        },
        "replay_same_next_token": replay_ok,
        "timing": {
            "load_s": round(load_s, 3),
            "ttft_s": round(ttft, 4),
            "decode_s": round(decode_s, 3),
            "decode_tokens_per_s": round(decode_tokens / decode_s, 3) if decode_s > 0 else None,
            "revocation_and_replay_s": round(replay_s, 3) if len(epochs) > 1 else None,
            "wall_s": round(ended - started, 3),
        },
        "recorder_ms_per_step": busy,
        "prompt_tokens": len(prompt),
        "generated_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
        "eos_in_continuation": any(t in engine.config.eos_ids for t in tokens),
    }


def exposure_section(cfg: RunConfig, prep: Prepared) -> dict:
    """What holding does not prove, for this model and N: the rank of what each worker observes
    (exposure.py) and the vocabulary-matching attack on each worker's layer-0 residual shard,
    run on this audit's own prompt (attack.py)."""
    from ..model.dense import DenseModel
    from ..structural.plan import make_plan
    from .attack import vocab_match
    from .exposure import analyse, summarize

    plan = make_plan(prep.config, cfg.workers, cfg.capacities)
    ranks = summarize(analyse(prep.src, plan), plan)
    dense = DenseModel(prep.src, 0)
    attacks = []
    for share in plan.workers:
        r = vocab_match(dense, prep.prompt, 0, list(range(*share.residual)))
        attacks.append(
            {"worker": share.worker, "layer": 0, "coords": r.coords, "recovered": r.recovered, "positions": r.positions}
        )
    return {"ranks": ranks, "attack": attacks}


def run_audit(cfg: RunConfig, log=print) -> dict:
    from .report import write_report

    prep = prepare(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for c in range(cfg.cold_starts):
        r = run_cold_start(cfg, c, prep)
        log(
            f"cold start {c}: {r['summary']}  ({r['timing']['wall_s']:.1f} s, "
            f"{r['timing']['decode_tokens_per_s']} tok/s)"
        )
        runs.append(r)
    summary = {
        "model": runs[0]["dir"] and json.loads((Path(runs[0]["dir"]) / S.MANIFEST).read_text())["model"],
        "workers": cfg.workers,
        "capacities": list(cfg.capacities) if cfg.capacities else None,
        "variant": cfg.variant,
        "inject_leak": cfg.inject_leak,
        "steps": cfg.steps,
        "batch": cfg.batch,
        "speculative": None if cfg.speculative is None else cfg.speculative.describe(),
        "cold_starts": cfg.cold_starts,
        "standby": cfg.spares,
        "revoke": {"worker": cfg.revoke_worker, "before_decode_step": cfg.revoke_at}
        if cfg.revoke_at is not None
        else None,
        "negative_control": cfg.negative_control,
        "all_ok": all(r["ok"] for r in runs),
        # the steps after each prefill: decode steps, and with speculation verification steps too
        "closed": f"{sum(r['closed_decode'] + r['closed_verify'] for r in runs)}/"
        f"{sum(r['decode_steps'] + r['verify_steps'] for r in runs)}",
        "identical_tokens_across_cold_starts": len({r["generated_sha256"] for r in runs}) == 1,
        "runs": runs,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    if cfg.exposure:
        # Minutes on a busy machine (a rank per layer, worker and coalition), with nothing else to show.
        log(
            f"exposure analysis: what each of the {cfg.workers} workers could reconstruct, per layer, and the "
            "vocabulary attack (--no-exposure skips it)"
        )
        t0 = time.perf_counter()
        summary["exposure"] = exposure_section(cfg, prep)
        log(f"exposure analysis done in {time.perf_counter() - t0:.1f} s")
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_report(summary, cfg.out / "report.md")
    return summary
