"""One version on the sending trainer rank of vLLM's trainer engine (``awex.engines.vllm_trainer``): pause every
engine, update it while the writers send, finish, resume, and say what it cost.

The order, per version:

1. Every engine is paused concurrently in the chosen mode (caches cleared; ``awex.engines.pause``). If one cannot
   be paused, those that were are resumed (nothing changed), no byte moves, and the version fails.
2. ``go/<version>/<call>`` tells the other trainer ranks to write; each engine's ``start_weight_update`` and
   ``update_weights`` run concurrently with this rank's writer.
3. The version counts as applied only when every engine's update returned, this rank's write returned, and every
   receiving rank published its receive report. Then ``finish_weight_update(weight_version=version)`` and the
   engines resume.
4. On failure an engine is resumed only where its weights are known to be the previous version's: it received
   ``staged``, or every one of its ranks reported failing before changing anything. Otherwise it stays paused,
   its weight version reads ``awex-failed:<version>``, a ``engine_paused`` event names it on the MetaServer, and
   it resumes when a later version applies.
5. An engine that was paused before the version by someone else (the user, where it can say so:
   ``awex.engines.pause.paused_now``) is paused again for its caches, updated, and left paused.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from awex.engines.errors import SyncFailedError
from awex.engines.outcome import Outcomes
from awex.engines.pause import FAILED_VERSION_PREFIX, Pauser, VersionStall, paused_now, set_weight_version
from awex.engines.sync import keys
from awex.meta import Layout, PlanError, PlanOptions, plan_transfers
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError, MetaTimeoutError

log = logging.getLogger("awex.engines.vllm")

SLACK = 30.0  # seconds an engine's call may outlive the sync's deadline (its own HTTP/RPC round trip)
STAGED_POLL_SECONDS = 0.25  # receive="staged": how often the wait for the ranks' staged words looks at the write


@dataclass(frozen=True)
class Engine:
    """One vLLM engine the trainer updates: its Awex instance name, vLLM's client for it, and its pauser."""

    instance: str
    client: Any
    pauser: Pauser


def _concurrently(
    work: dict[str, Callable[[], None]], deadline: float, what: str
) -> tuple[dict[str, float], dict[str, BaseException]]:
    """Run each callable in a thread of its own; when each finished (monotonic) and what each raised. A thread
    still running at ``deadline`` counts as a ``TimeoutError``."""
    done: dict[str, float] = {}
    errors: dict[str, BaseException] = {}

    def run(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            done[name] = time.monotonic()
        except BaseException as e:  # reported by the caller, with the engine named
            errors[name] = e

    threads = {
        name: threading.Thread(target=run, args=(name, fn), name=f"awex-{what}-{name}", daemon=True)
        for name, fn in work.items()
    }
    for t in threads.values():
        t.start()
    for name, t in threads.items():
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            errors[name] = TimeoutError(f"{what} did not return within the deadline")
    return done, errors


def _begin(client: Any, stage: dict) -> None:
    try:
        client.start_weight_update()
    except Exception as e:  # a staged version whose trainer died before its word leaves the update open: end it
        log.warning("awex: could not start a weight update (%s); ending one left open (its trainer gone?)", e)
        try:
            client.finish_weight_update(weight_version=None)  # drops what it staged, nothing applied
        except Exception as again:  # none was open: the start's own error stands
            raise e from again
        client.start_weight_update()
    client.update_weights(stage)


def _capture(fn: Callable[[], None], out: dict[str, BaseException | None]) -> None:
    try:
        fn()
        out["(writer)"] = None
    except BaseException as e:  # reported by the caller
        out["(writer)"] = e


def _failures(errors: dict[str, BaseException]) -> tuple[dict[tuple[str, int], dict | None], dict[str, str]]:
    """The receiving ranks that failed and every cause, from what each party raised."""
    failed: dict[tuple[str, int], dict | None] = {}
    causes = {name: _describe(e) for name, e in errors.items() if not isinstance(e, SyncFailedError)}
    for e in errors.values():
        if isinstance(e, SyncFailedError):
            failed.update(e.failed)
            causes.update(e.causes)
    return failed, causes


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


class VersionSender:
    """The sending rank's side of each version (one per trainer engine): :meth:`send` pauses, updates, finishes
    and resumes every engine around this rank's ``write``."""

    def __init__(self, engines: list[Engine], meta: MetaClient, *, mode: str, staged: bool, timeout: float):
        self.engines = {e.instance: e for e in engines}
        self.meta = meta
        self.mode = mode
        self.staged = staged
        self.timeout = timeout
        self.left_paused: set[str] = set()  # engines a failed version left paused on changed weights
        self.user_paused: set[str] = set()  # engines paused before the version, not by Awex: not resumed
        self.unstaged: dict[str, str] = {}  # staged: engines whose ranks cannot stage (budget), and why
        self._worlds: dict[str, int] = {}

    def preflight(self, trainer: Layout, options: PlanOptions, exact: bool = False) -> None:
        """Plan once against every engine's published layout (set up by ``init_weight_transfer_engine``), so that a
        trainer an engine cannot receive from (another model, a narrowing cast not allowed) is refused at set-up,
        before any engine is paused or any byte moves. ``exact``: each engine must hold every tensor the trainer sends
        (LoRA adapters: a module the engine's adapter lacks would otherwise be left out unsaid)."""
        engines = [self.meta.fetch_layout(name, "current", timeout=self.timeout) for name in sorted(self.engines)]
        for layout in engines if exact else ():
            extra = sorted(set(trainer.names) - set(layout.names))
            if extra:
                raise AwexValueError(
                    f"awex: {layout.instance} does not hold {len(extra)} tensor(s) this trainer sends, e.g. "
                    f"{extra[:3]}: its adapters target other modules (serve the trainer's adapters)"
                )
        for layout in engines:
            self._worlds[layout.instance] = layout.world_size
            for rank in range(layout.world_size) if self.staged else ():
                said = self.meta.get(keys.staging(layout.instance, rank), timeout=self.timeout)
                if not (isinstance(said, dict) and said.get("staged") is True):
                    why = said.get("reason") if isinstance(said, dict) else None
                    self.unstaged[layout.instance] = f"rank {rank}: {why or 'cannot stage'}"
        if self.unstaged:
            log.warning(
                "awex: %s cannot receive while generating (%s): every version pauses for the transfer",
                ", ".join(sorted(self.unstaged)),
                "; ".join(f"{k} {v}" for k, v in sorted(self.unstaged.items())),
            )
        try:
            plan_transfers([trainer], engines, options)
        except PlanError as e:
            raise AwexValueError(f"awex: the engines cannot receive this trainer's weights: {e}") from None

    def send(
        self, version: str, call: int, instances: list[str], write: Callable[[], None], validate: str | None
    ) -> dict[str, VersionStall]:
        """Version ``version`` to ``instances`` (this rank's write is ``write``); the stall per engine, or
        :class:`SyncFailedError` naming every party that failed."""
        if self.staged and not self.unstaged:
            return self._send_staged(version, call, instances, write, validate)
        started = time.monotonic()
        engines = [self.engines[name] for name in instances]
        paused_at, pause_errors = _concurrently(
            {e.instance: (lambda e=e: self._pause(e)) for e in engines}, started + self.timeout, "pause"
        )
        if pause_errors:
            causes = {f"{name} (pause)": _describe(e) for name, e in pause_errors.items()}
            self.meta.put(keys.go(version, call), {"ok": False, "error": str(causes)[:4000]})
            self._resume([e for e in engines if e.instance in paused_at and e.instance not in self.left_paused])
            raise SyncFailedError(version, {}, causes)
        self.meta.put(keys.go(version, call), {"ok": True})
        update = {"version": version, "timeout": self.timeout, "validate": validate}

        def drive(engine: Engine) -> None:
            engine.client.start_weight_update()
            engine.client.update_weights(update)

        work: dict[str, Callable[[], None]] = {e.instance: (lambda e=e: drive(e)) for e in engines}
        work["(writer)"] = write  # this rank's own shards, in a thread like the rest: one deadline for all
        _, errors = _concurrently(work, started + self.timeout + SLACK, "update")
        failed, causes = _failures(errors)
        if not errors:
            self._check_reports(version, instances, started + self.timeout, causes)
        ok = not failed and not causes
        intact = {e.instance for e in engines if ok or self._intact(e.instance, failed)}
        ok = self._finish(engines, set(errors), version, ok, intact, causes)
        synced = time.monotonic()
        resume = [e for e in engines if e.instance in intact]
        resumed_at, resume_errors = self._resume(resume)
        for name, err in resume_errors.items():
            causes.setdefault(f"{name} (resume)", _describe(err))
        stalls = {
            e.instance: VersionStall(
                version,
                e.instance,
                self.mode,
                paused_at[e.instance] - started,
                synced - paused_at[e.instance],
                resumed_at[e.instance] - paused_at[e.instance] if e.instance in resumed_at else None,
            )
            for e in engines
        }
        return self._verdict(version, engines, ok and not causes, intact, failed, causes, stalls)

    def _send_staged(
        self, version: str, call: int, instances: list[str], write: Callable[[], None], validate: str | None
    ) -> dict[str, VersionStall]:
        """``receive="staged"``: the engines receive while they generate (``awex.engines.staged_version``); once
        every rank of every engine holds the whole version they are paused, commit (their ranks' outcomes, hence
        ``write``, come after it) and resume. A version that fails before that is dropped on every engine, none
        paused and none changed."""
        started = time.monotonic()
        deadline = started + self.timeout
        engines = [self.engines[name] for name in instances]
        self.meta.put(keys.go(version, call), {"ok": True})
        wrote: dict[str, BaseException | None] = {}
        writer = threading.Thread(target=_capture, args=(write, wrote), name=f"awex-write-{version}", daemon=True)
        writer.start()  # this rank's own shards; the engines' receives meet it
        stage = {"version": version, "timeout": self.timeout, "validate": validate, "stage": True}
        begun, errors = _concurrently(
            {e.instance: (lambda e=e: _begin(e.client, stage)) for e in engines}, deadline, "stage"
        )
        staged_at = self._await_staged(version, engines, writer, deadline) if not errors else None
        paused_at: dict[str, float] = {}
        if staged_at is not None:  # every rank holds it: pause for the commit alone
            paused_at, pause_errors = _concurrently(
                {e.instance: (lambda e=e: self._pause(e)) for e in engines}, deadline, "pause"
            )
            errors.update({f"{name} (pause)": e for name, e in pause_errors.items()})
        commit = staged_at is not None and not errors
        decided_at, decide_errors = _concurrently(
            {
                e.instance: (lambda e=e: e.client.update_weights({"version": version, "commit": commit}))
                for e in engines
                if e.instance in begun
            },
            deadline + SLACK,
            "commit" if commit else "drop",
        )
        errors.update(decide_errors)
        writer.join(max(0.0, deadline + SLACK - time.monotonic()))
        if writer.is_alive():
            wrote["(writer)"] = TimeoutError("the write did not return within the deadline")
        errors.update({name: e for name, e in wrote.items() if e is not None})
        failed, causes = _failures(errors)
        if commit and not causes and not failed:
            self._check_reports(version, instances, deadline, causes)
        ok = commit and not failed and not causes
        # dropped before any commit: every engine holds its previous version whole
        intact = {e.instance for e in engines if ok or not commit or self._intact(e.instance, failed)}
        ok = self._finish(engines, set(errors) | (set(instances) - set(begun)), version, ok, intact, causes)
        resumed_at, resume_errors = self._resume([e for e in engines if e.instance in paused_at.keys() & intact])
        for name, err in resume_errors.items():
            causes.setdefault(f"{name} (resume)", _describe(err))
        stalls = {}
        for e in engines:
            paused, decided = paused_at.get(e.instance), decided_at.get(e.instance)
            stalls[e.instance] = VersionStall(
                version,
                e.instance,
                self.mode,
                paused - staged_at if paused is not None else 0.0,
                (staged_at if staged_at is not None else time.monotonic()) - started,
                0.0 if paused is None else resumed_at[e.instance] - paused if e.instance in resumed_at else None,
                commit_seconds=None if paused is None or decided is None else decided - paused,
            )
        return self._verdict(version, engines, ok and not causes, intact, failed, causes, stalls)

    def _verdict(
        self,
        version: str,
        engines: list[Engine],
        ok: bool,
        intact: set[str],
        failed: dict[tuple[str, int], dict | None],
        causes: dict[str, str],
        stalls: dict[str, VersionStall],
    ) -> dict[str, VersionStall]:
        """The stalls of a version that applied; else the engines not intact stay paused and it raises."""
        if ok:
            return stalls
        for e in engines:
            if e.instance not in intact:
                self._leave_paused(e.instance, version)
        raise SyncFailedError(version, failed, causes)

    def _check_reports(self, version: str, instances: list[str], deadline: float, causes: dict[str, str]) -> None:
        missing = self._missing_reports(version, instances, max(0.1, deadline - time.monotonic()))
        if missing:
            causes["receivers"] = f"no receive report from {', '.join(missing[:8])}"

    def _finish(
        self, engines: list[Engine], ended: set[str], version: str, ok: bool, intact: set[str], causes: dict[str, str]
    ) -> bool:
        """End every engine's update (where it did not end itself: ``ended``) naming the version it holds (none where
        the version failed; ``awex-failed:<version>`` where its weights changed); whether all of it succeeded."""
        for e in engines:  # an update that raised was ended by the engine itself: only its name changes
            try:
                if e.instance not in ended:
                    e.client.finish_weight_update(weight_version=version if ok else None)
                if not ok and e.instance not in intact:
                    set_weight_version(e.client, f"{FAILED_VERSION_PREFIX}{version}")
            except BaseException as err:
                causes.setdefault(f"{e.instance} (finish)", _describe(err))
                ok = False
        return ok

    def _await_staged(self, version: str, engines: list[Engine], writer: threading.Thread, deadline: float):
        """When every receiving rank of ``engines`` said it holds ``version`` staged (monotonic), or ``None`` if the
        writer ended first (it failed: the ranks' outcomes came) or the deadline passed."""
        waiting = [
            keys.staged(version, e.instance, rank) for e in engines for rank in range(self._world(e.instance, deadline))
        ]
        while waiting and time.monotonic() < deadline:
            try:
                self.meta.get(waiting[0], timeout=max(0.001, min(STAGED_POLL_SECONDS, deadline - time.monotonic())))
                waiting.pop(0)
            except MetaTimeoutError:
                if not writer.is_alive():  # the write ended before every rank held the version: it failed
                    return None
        return None if waiting else time.monotonic()

    def _world(self, instance: str, deadline: float, fresh: bool = False) -> int:
        """How many ranks ``instance`` has (its published layout; read again where ``fresh``)."""
        if fresh or instance not in self._worlds:
            layout = self.meta.fetch_layout(instance, "current", timeout=max(0.1, deadline - time.monotonic()))
            self._worlds[instance] = layout.world_size
        return self._worlds[instance]

    def _pause(self, engine: Engine) -> None:
        """Pause ``engine``, noting first whether someone else had paused it (then it is not resumed after)."""
        if paused_now(engine.pauser) and engine.instance not in self.left_paused:
            self.user_paused.add(engine.instance)
            log.info("awex: %s was paused before the version: it stays paused after it", engine.instance)
        else:
            self.user_paused.discard(engine.instance)
        engine.pauser.pause(self.mode)

    def _resume(self, engines: list[Engine]) -> tuple[dict[str, float], dict[str, BaseException]]:
        """Resume ``engines`` but those someone else paused before the version; when each was resumed."""
        engines = [e for e in engines if e.instance not in self.user_paused]
        done, errors = _concurrently(
            {e.instance: e.pauser.resume for e in engines}, time.monotonic() + self.timeout, "resume"
        )
        self.left_paused -= set(done)
        return done, errors

    def _intact(self, instance: str, failed: Outcomes) -> bool:
        """Whether ``instance`` still holds the previous version whole after a failed one: it received staged and
        none of its ranks began loading, or every rank reported failing before changing anything."""
        mine = {rank: o for (name, rank), o in failed.items() if name == instance}
        if any(o is None or o.partial for o in mine.values()):
            return False
        if self.staged:
            return True
        try:
            world = self._world(instance, time.monotonic() + 10.0)
        except Exception:
            return False
        return len(mine) == world

    def _leave_paused(self, instance: str, version: str) -> None:
        self.left_paused.add(instance)
        log.error(
            "awex: %s failed on %s after its weights may have changed in place: generation stays paused (weight "
            "version %s%s) until a later version applies",
            version,
            instance,
            FAILED_VERSION_PREFIX,
            version,
        )
        try:
            self.meta.publish_event("engine_paused", instance, version=version, data="failed in place; paused")
        except Exception as e:
            log.warning("awex: could not publish that %s stays paused: %s", instance, e)

    def _missing_reports(self, version: str, instances: list[str], timeout: float) -> list[str]:
        """The receiving ranks whose report of ``version`` is not on the MetaServer (waiting up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        missing = []
        for instance in instances:
            for rank in range(self._world(instance, deadline, fresh=True)):
                try:
                    self.meta.get(keys.received(version, instance, rank), timeout=max(0.1, deadline - time.monotonic()))
                except Exception:
                    missing.append(f"{instance}:{rank}")
        return missing

    def abort(self, resume: bool) -> list[str]:
        """Give up on the failed version that left engines paused: with ``resume`` they generate again on the weights
        they hold (a mix of two versions: for stacks that accept it), else they stay paused until a version
        applies. Returns the engines still paused."""
        if resume:
            left = [self.engines[name] for name in sorted(self.left_paused)]
            _, errors = self._resume(left)
            for name, e in errors.items():
                log.error("awex: could not resume %s: %s", name, e)
            for e in left:
                if e.instance not in self.left_paused:
                    log.warning("awex: %s resumed on the weights it holds (not a whole version)", e.instance)
        return sorted(self.left_paused)
