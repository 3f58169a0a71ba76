"""Every comparison refit-verify makes: manifests, sessions, receivers' answers, engine states, replicas.

Pure functions over the records the workers and the trainer produce (:mod:`refit_verify.manifest`,
:mod:`refit_verify.report`); no tensor is read here. The trainer acts on the reports they return
(:func:`refit_verify.config.act_on`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from refit_verify.errors import RefitInputError
from refit_verify.manifest import CLOSE_AUDIT, EngineSnapshot, SessionManifest, TensorState
from refit_verify.report import Manifest, VerificationReport

__all__ = ["StateComparison", "check_digest", "compare_manifests", "compare_replicas", "compare_session", "compare_states",
           "receiver_report", "wrote_wrong"]


_HEX = frozenset("0123456789abcdef")


_HEX_RUN = re.compile("[0-9a-f]*")


_STR = {str}


_LEN32 = {32}


def _check_manifest(m: object, side: str) -> dict[str, str]:
    """``m`` as a plain dict of the pairs checked (what the comparison then reads), or RefitInputError."""
    if not isinstance(m, Mapping):
        raise RefitInputError(f"{side} manifest must be a mapping of name to 32-hex digest, got {type(m).__name__}")
    items = list(m.items())  # the pairs a comparison reads; the common case in a few C-level passes over them
    names, values = (list(x) for x in zip(*items)) if items else ([], [])
    if set(map(type, names)) <= _STR and set(map(type, values)) <= _STR and set(map(len, values)) <= _LEN32 \
            and _HEX_RUN.fullmatch("".join(values)):
        return dict(items)
    for k, v in items:  # name the first bad entry
        if not isinstance(k, str) or not (isinstance(v, str) and len(v) == 32 and _HEX.issuperset(v)):
            raise RefitInputError(f"{side} manifest entry {k!r}: {v!r} is not a 32-character lowercase hex digest")
    return dict(items)


def _plain_str_pairs(m: dict) -> bool:
    """True iff every key and value of ``m`` is exactly a ``str`` (no subclass with its own ``__eq__``)."""
    return set(map(type, m)) <= _STR and set(map(type, m.values())) <= _STR


def compare_manifests(sender: Manifest, receiver: Manifest, *, rank: int | None = None,
                      rejected: Mapping[str, str] | None = None, receiver_error: str | None = None) -> VerificationReport:
    """Compare a sender manifest with a receiver manifest over the union of their names.

    Args:
        sender: ``{name: 32-hex digest}`` of what the trainer exported.
        receiver: ``{name: 32-hex digest}`` of what one vLLM worker loaded.
        rank: the worker's rank, carried into the report.
        rejected: ``{name: reason}`` of entries the receiver refused (from ``Done.rejected``).
        receiver_error: the receiver's other errors (from ``Done.error``).

    Returns:
        VerificationReport: ``ok`` is True only if both have the same names and equal digests, the
        receiver rejected nothing and at least one name was compared (two empty manifests verify nothing).
    """
    sender = _check_manifest(sender, "sender")  # plain dicts of the pairs checked: a Mapping whose views disagree
    if type(receiver) is dict and _plain_str_pairs(receiver) and _plain_str_pairs(sender) \
            and receiver == sender:  # the common case: str pairs equal to the sender's, checked just now (no __eq__ of
        # a str subclass on either side decides the ==)
        return VerificationReport((), (), (), sender, dict(receiver), rank, dict(rejected or {}), receiver_error)
    receiver = _check_manifest(receiver, "receiver")  # is compared as it was checked
    mismatched = tuple(k for k, v in sender.items() if k in receiver and receiver[k] != v)
    missing = tuple(k for k in sender if k not in receiver)
    unexpected = tuple(k for k in receiver if k not in sender)
    return VerificationReport(mismatched, missing, unexpected, sender, receiver, rank, dict(rejected or {}), receiver_error)


def check_digest(got: str | None, want: str | None) -> str | None:
    """Why a tensor whose digest is ``got`` must not be loaded against the sender's ``want`` (None: it may)."""
    if want is None:
        return "it carries no sender digest, so its bytes cannot be checked before loading"
    if got != want:
        return (f"its digest {got} differs from the sender's {want}: the bytes changed between the sender's digest and "
                "this load (corrupted in staging or transit, or the trainer's tensor written while it was being sent)")
    return None


def stale_problems(stale: str | None) -> list[str]:
    """The report's ``problems`` entry for a worker session out of order (``stale``: the worker's
    :attr:`SessionManifest.stale <refit_verify.manifest.SessionManifest.stale>`); empty when it is None."""
    return [f"stale refit: {stale}"] if stale else []


def receiver_report(sender_manifest: dict[str, str] | None, manifest: dict[str, str], session: SessionManifest | None, *,
                    refit_id: str, rejected: dict[str, str], error: str | None, rank: int | None,
                    producer_rank: int | None = None, landed: list[str] | None = None,
                    kept: dict[str, str] | None = None, version: int | None = None,
                    stale: str | None = None) -> VerificationReport:
    """Compare one receiver's answer with the sender's manifest (not yet acted on).

    With a ``session`` (the receiver loaded into a vLLM model and digested at its boundary), the
    comparison is :func:`refit_verify.compare.compare_session` (coverage, identity and read-back
    too); else :func:`refit_verify.compare.compare_manifests`. ``rejected`` and ``error`` are
    carried into the report; ``rank`` labels it; ``landed`` / ``kept`` (what the receiver's engine
    holds, when the digests came ahead of the bytes) become ``report.landed`` / ``report.kept``;
    ``version``: the weight version the sender named (checked against the session's, with its order);
    ``stale``: without a ``session``, why the receiver's worker session was out of order (a problem).
    ``report.receiver_error`` holds the session's errors (its close's checks that failed or found a
    fault, :func:`compare_session`) and then ``error``, joined by ``"; "``.
    """
    extra = {"landed": tuple(landed or ()), "kept": dict(kept or {})}
    if session is not None:
        base = compare_session({"model": sender_manifest or {}}, session, session=refit_id, version=version,
                               producer_rank=producer_rank)
        # the session's own errors (a check at the close that failed or found a fault) stay: never replaced by Done's
        err = "; ".join(e for e in (base.receiver_error, error) if e) or None
        return dataclasses.replace(base, rejected=dict(rejected), receiver_error=err, rank=rank if rank is not None else base.rank,
                                   **extra)
    base = compare_manifests(sender_manifest, manifest, rejected=dict(rejected), receiver_error=error, rank=rank)
    return dataclasses.replace(base, problems=(*base.problems, *stale_problems(stale)), **extra)


def wrote_wrong(expected: Mapping[str, Mapping[str, str]], man: SessionManifest, rep: VerificationReport, *,
                sender_problems: Iterable[str] = (), undigested: Iterable[str] = (),
                producer_rank: int | None = None) -> set[str] | None:
    """The parameters (worker labels) the failed session of ``man`` wrote with bytes other than the
    trainer's, when its failure names them (``rep``: its report; the other arguments as
    :func:`compare_session` got them): read-back mismatches and the parameters fed the tensors that
    differ. None when it fails for what names no parameter (an identity or version problem, an
    error, an unexpected tensor, a mismatch with no read-back to place it). Changes outside any
    refit its close found do not count here (the worker records them); tensors refused before
    loading wrote nothing."""
    # names judged by the engine state that differ count as mismatched names (placed below), not as a problem
    judged = {k: msgspec.structs.replace(mm, by_state={}) for k, mm in man.modules.items()}
    own = compare_session(expected, msgspec.structs.replace(man, audits=[], unsessioned=[], modules=judged), session=rep.session,
                          version=rep.version, partial=rep.unchanged > 0 or man.partial, producer_rank=producer_rank,
                          sender_problems=sender_problems, undigested=undigested)
    if own.problems or own.unexpected or own.receiver_error or own.nothing_checked:
        return None
    out = set(own.engine_mismatched)
    names = set(own.mismatched) - set(rep.rejected)  # refused before loading: wrote nothing
    if names:
        if man.engine is None:
            return None
        placed: set[str] = set()
        for label, st in man.engine.params.items():
            role, sep, _ = label.partition(":")
            prefix = f"{role}:" if sep and role in man.modules else ""
            fed = {prefix + src for src, _where in st.blocks or ()} & names
            if fed:
                out.add(label)
                placed |= fed
        if placed != names:
            return None
    return out


def compare_session(expected: Mapping[str, Mapping[str, str]], man: SessionManifest, *, session: str | None = None,
                    version: int | None = None, partial: bool = False, producer_rank: int | None = None,
                 sender_problems: Iterable[str] = (), undigested: Iterable[str] = ()) -> VerificationReport:
    """Compare one worker's session manifest with what the trainer pushed.

    Args:
        expected: ``{module: {name: 32-hex}}`` the trainer digested (``"model"``, ``"drafter"``).
        man: the worker's manifest.
        session: the session id the trainer opened (a manifest of another session is a failure).
        version: the weight version the trainer pushed (another one in the manifest is a failure).
        partial: the refit does not write every parameter: unwritten parameters are not failures.
        producer_rank: for multi-producer transports, the trainer rank that sent this payload.
        sender_problems: what the trainer could not digest as it pushed it (a held tensor that
            changed before the end of the refit); each is a failure.
        undigested: the names those problems are about (drafter ones as ``"drafter:name"``): the
            worker's digests of them are not reported again as unexpected.

    Returns:
        VerificationReport: digests compared per module; coverage, identity and read-back checks in
        its session fields; the worker's certificate fields (state digest, close time). ``ok`` only
        if all pass and something was compared: a partial refit that stated and loaded no tensor
        passes only when the worker's close found the parameters holding what the previous session
        left (``report.unchanged``); a full one fails, as does any with no previous state.
    """
    sender: dict[str, str] = {}
    receiver: dict[str, str] = {}
    mismatched: list[str] = []
    missing: list[str] = []
    unexpected: list[str] = []
    unconsumed: list[str] = []
    unwritten: list[str] = []
    unattributed: list[str] = []
    problems: list[str] = list(sender_problems)
    skip = set(undigested)
    unchecked: list[str] = []
    landed_mismatched: set[str] = set()  # digested where they landed, and not what the trainer sent
    for module in sorted(set(expected) | set(man.modules), key=lambda m: (m != "model", m)):
        exp = dict(expected.get(module, {}))
        got = man.modules.get(module)
        digests = dict(got.digests) if got is not None else {}
        if module != "model" and not exp and not digests:
            if got is not None and got.unwritten and not (partial or man.partial):
                unchecked.append(f"{module}: no tensor of this refit was for it; its {len(got.unwritten)} parameters keep "
                                 "their previous weights (speculative decoding stays lossless; r.add(name, t, module="
                                 f"{module!r}) to refit and verify it)")
            continue
        tag = (lambda n: n) if module == "model" else (lambda n, m=module: f"{m}:{n}")
        r = compare_manifests(exp, digests)
        if module == "model":
            sender.update(exp)
            receiver.update(digests)
        else:
            sender.update({tag(k): v for k, v in exp.items()})
            receiver.update({tag(k): v for k, v in digests.items()})
        mismatched += [tag(n) for n in r.mismatched]
        missing += [tag(n) for n in r.missing]
        unexpected += [tag(n) for n in r.unexpected if tag(n) not in skip]
        if got is None:
            continue
        landed_bad = [tag(n) for n in got.in_place if n in r.mismatched]
        landed_mismatched.update(landed_bad)
        if landed_bad:
            problems.append(f"{len(landed_bad)} tensors were digested where they landed in the engine (not on delivery) and the "
                            "engine holds other bytes there than the trainer sent: a corrupted delivery or a loader that put "
                            f"them elsewhere: {', '.join(landed_bad[:10])}")
        by_state = [n for n in got.by_state if n in r.mismatched]
        if by_state:
            problems.append(f"{len(by_state)} tensors that no load_weights delivered were judged by the engine state (the layout "
                            f"map), and {man.worker.label()} holds other bytes than the trainer's there: "
                            + "; ".join(f"{tag(n)} at {got.by_state[n]}" for n in by_state[:10])
                            + (f"; … (+{len(by_state) - 10})" if len(by_state) > 10 else ""))
        if got.not_provable:
            items = list(got.not_provable.items())
            problems.append(f"{len(items)} tensors the trainer announced reached {man.worker.label()} through no load_weights and "
                            "cannot be judged by its state (not provable): " + "; ".join(f"{tag(n)} ({why})" for n, why in items[:10])
                            + (f"; … (+{len(items) - 10})" if len(items) > 10 else ""))
        if got.state_padding:
            unchecked.append("padding a loader fills (no trainer tensor's) in parameters judged by the engine state is excluded "
                             "from the layout map and not compared: " + ", ".join(f"{tag(p)} {w}" for p, w in got.state_padding.items()))
        changed = [tag(n) for n in got.changed_after_delivery if tag(n) not in mismatched]
        if changed:
            mismatched += changed
            problems.append(f"{len(changed)} delivered tensors changed between load_weights and vLLM's deferred apply "
                            f"(what landed is not what was delivered): {', '.join(changed[:10])}")
        for n, why in got.coverage_unknown.items():
            unchecked.append(f"coverage of {tag(n)}: {why}; which of its elements this refit wrote is unknown")
        unconsumed += [tag(n) for n in got.unconsumed]
        unattributed += [tag(n) for n in got.unattributed]
        if not (partial or man.partial):
            unwritten += [tag(n) for n in got.unwritten]
        else:  # a parameter written in part whose other elements the close could not compare region by region
            part = [tag(n) for n in got.unwritten if n.endswith(" elements)")]
            if part:
                unchecked.append(f"{len(part)} parameters were written in part by this partial refit; their other elements are "
                                 "not compared with what the last session left (no region of the layout map holds them, or "
                                 "the last close did not read it; before any close, prepare at engine start did not): "
                                 f"{', '.join(part[:6])}" + (", …" if len(part) > 6 else ""))
    if session is not None and man.session != session:
        problems.append(f"the manifest is of session {man.session!r}, not {session!r}")
    if version is not None and man.version != version:
        problems.append(f"the worker recorded version {man.version}, the trainer pushed version {version}")
    problems += stale_problems(man.stale)
    problems += [f"delta refit: {d}" for d in man.delta]
    if man.misrouted:
        problems.append(f"misrouted payload: {man.misrouted}")
    for u in man.unsessioned:
        shown = ", ".join(u.names[:8]) + (", …" if u.tensors > len(u.names[:8]) else "")
        problems.append(f"{u.tensors} tensors were loaded into {u.module} outside any session ({u.calls} {u.where} calls "
                        f"before this session): {shown}")
    for a in man.audits:
        when = ((f"since {'the last session' if a.since_session is not None else 'the engine started'}, in parameters "
                 "this session did not write") if a.trigger == CLOSE_AUDIT else "outside any refit before this session")
        problems.append(f"the engine's state changed {when} ({a.describe()})")
    if producer_rank is not None and man.producer is not None and man.producer.rank != producer_rank:
        problems.append(f"the worker received the payload of producer rank {man.producer.rank}, not of rank {producer_rank}")
    unchanged = man.unchanged if partial or man.partial else 0
    if unchanged and not sender and not receiver:
        unchecked.append(f"no tensor was stated or loaded (an empty partial refit): nothing of the trainer's was compared; the "
                         f"close found the engine's {unchanged} parameters holding the bytes session {man.unchanged_since!r} left")
    engine_bad: list[str] = []
    not_proven: dict[str, str] = {}
    proven = unproven = None
    if man.engine is None and not any(e.startswith("read-back failed") for e in man.errors):
        unchecked.append("read-back did not run (readback=False, or no read-back on this worker): what reached load_weights "
                         "was checked, not what the engine holds after loading")
    if man.engine is not None:
        proven, unproven = man.engine.proven_bytes, man.engine.unproven_bytes
        for pname, st in man.engine.params.items():
            if st.status == "verified":
                if not landed_mismatched:
                    continue
                role, sep, _ = pname.partition(":")
                prefix = f"{role}:" if sep and role in man.modules else ""
                if any(prefix + src in landed_mismatched for src, _where in st.blocks or ()):
                    # its blocks were the landed digests themselves: the engine holds other bytes than the trainer's
                    engine_bad.append(pname)
                    proven, unproven = proven - st.bytes, unproven + st.bytes
            elif st.status == "mismatch":
                engine_bad.append(pname)
            elif st.status != "verified":
                not_proven[pname] = st.why or st.status
    return VerificationReport(
        tuple(mismatched), tuple(missing), tuple(unexpected), sender, receiver, man.worker.rank, {},
        "; ".join(man.errors) if man.errors else None, session=man.session, version=man.version,
        worker=man.worker.label(), unconsumed=tuple(unconsumed), unwritten=tuple(unwritten),
        engine_mismatched=tuple(engine_bad), problems=tuple(problems), not_proven=not_proven,
        unattributed=tuple(unattributed), proven_bytes=proven, unproven_bytes=unproven, unchecked=tuple(unchecked),
        unchanged=unchanged, state_digest=man.state_digest, closed_at=man.closed_at or None)


@dataclass(frozen=True)
class StateComparison:
    """Parameters that differ between engine states that must be equal (replicas, a canary).

    Attributes:
        differing: ``{name: description}`` naming the ranks or engines that disagree.
        not_comparable: ``{name: why}`` (empty tensors whose bytes live in a kernel-packed form,
            shapes that differ by layout).
        compared: number of tensors compared.

    ``ok`` needs no difference and at least one tensor compared: nothing compared is never a pass.
    """

    differing: dict[str, str] = field(default_factory=dict)
    not_comparable: dict[str, str] = field(default_factory=dict)
    compared: int = 0

    @property
    def ok(self) -> bool:
        return not self.differing and self.compared > 0

    def describe(self, what: str, limit: int = 20) -> str:
        extra = ""
        if self.not_comparable:
            nc = list(self.not_comparable.items())
            extra = (f"; {len(nc)} not comparable, so not checked: " + "; ".join(f"{k} ({v})" for k, v in nc[:limit])
                     + (f"; … (+{len(nc) - limit})" if len(nc) > limit else ""))
        if self.ok:
            return f"{what}: {self.compared} tensors identical{extra}"
        if not self.differing:
            return (f"{what}: nothing compared (no tensor that two of them must hold alike: one replica of each rank, "
                    f"no tensor-parallel replicated tensor, or no tensor at all){extra}")
        items = list(self.differing.items())
        shown = "; ".join(f"{k}: {v}" for k, v in items[:limit]) + (f"; … (+{len(items) - limit})" if len(items) > limit else "")
        return f"{what} disagree on {len(items)} tensors: {shown}{extra}"


def compare_states(a: EngineSnapshot, b: EngineSnapshot, labels: tuple[str, str] = ("refitted", "cold-loaded")) -> StateComparison:
    """Compare two engine states tensor by tensor (the cold-load canary: a warm refit must leave
    exactly what a cold load leaves)."""
    differing, not_comparable = {}, {}
    n = 0
    for kind in ("params", "buffers"):
        x, y = getattr(a, kind), getattr(b, kind)
        for name in sorted(set(x) | set(y)):
            s, t = x.get(name), y.get(name)
            if s is None or t is None:
                differing[name] = f"only in the {labels[0] if t is None else labels[1]} engine"
                continue
            if 0 in s.shape or 0 in t.shape:
                not_comparable[name] = "empty tensor (its bytes live in a kernel-packed form vLLM does not expose)"
                continue
            n += 1
            if s.digest != t.digest:
                differing[name] = f"{labels[0]} {s.digest} != {labels[1]} {t.digest}"
    return StateComparison(differing, not_comparable, n)


def compare_replicas(states: list[EngineSnapshot]) -> StateComparison:
    """Compare the engine states of replicas: every data-parallel replica of the same (tp, pp) rank
    must hold identical tensors, and tensor-parallel ranks identical replicated ones.

    Parameters and persistent buffers are compared among replicas of one rank, replicated parameters
    across tensor-parallel ranks. A tensor on which the holders disagree is named with the ranks that
    differ from the majority (with two holders, both are named); a tensor some replicas of a rank hold
    and others lack is named with the replicas that lack it.
    """
    differing, not_comparable = {}, {}
    n = 0
    groups: dict[tuple, list[EngineSnapshot]] = {}
    for st in states:
        groups.setdefault((st.worker.tp, st.worker.pp), []).append(st)
    checks: list[tuple[str, list[tuple[EngineSnapshot, TensorState]]]] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        for kind, suffix in (("params", ""), ("buffers", " (buffer)")):
            for name in sorted(set().union(*(getattr(m, kind) for m in members))):
                held = [m for m in members if name in getattr(m, kind)]
                if len(held) < len(members):  # replicas of one rank hold the same tensors: one lacking it missed them
                    differing[name + suffix] = ("missing on " + ", ".join(m.worker.label() for m in members if m not in held)
                                                + " (held by " + ", ".join(m.worker.label() for m in held) + ")")
                    continue
                checks.append((name + suffix, [(m, getattr(m, kind)[name]) for m in members]))
    by_pp: dict[int, list[EngineSnapshot]] = {}
    for st in states:
        by_pp.setdefault(st.worker.pp, []).append(st)
    for members in by_pp.values():
        tps = {m.worker.tp for m in members}
        if len(tps) < 2:
            continue
        names = {n for m in members for n, t in m.params.items() if t.replicated}
        for name in sorted(names):
            checks.append((f"{name} (tensor-parallel replicated)", [(m, m.params[name]) for m in members if name in m.params]))
    for name, holders in checks:
        if len(holders) < 2:
            continue
        if any(0 in t.shape for _, t in holders):
            not_comparable[name] = "empty tensor (kernel-packed)"
            continue
        n += 1
        counts: dict[str, int] = {}
        for _, t in holders:
            counts[t.digest] = counts.get(t.digest, 0) + 1
        if len(counts) == 1:
            continue
        top, top_n = max(counts.items(), key=lambda kv: kv[1])
        if top_n > len(holders) / 2:  # a majority: the others differ
            odd = [(m, t) for m, t in holders if t.digest != top]
        else:  # no majority: name the holders whose last write is older than the newest (they missed a refit)
            newest = max((t.written_version for _, t in holders if t.written_version is not None), default=None)
            odd = [(m, t) for m, t in holders if newest is not None and (t.written_version is None or t.written_version < newest)]
            odd = odd or list(holders)
        differing[name] = "differs on " + ", ".join(
            m.worker.label() + (f" (last written at version {t.written_version})" if t.written_version is not None else " (never written by a refit)")
            for m, t in odd)
    return StateComparison(differing, not_comparable, n)
