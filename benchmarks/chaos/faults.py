"""Each scheduled fault done to a running job, and the job's recovery from it, measured.

Note [Chaos run]
    One fault at a time. A fault fires once the training has completed ``gap`` steps past
    the previous fault's recovery, so a checkpoint always lies between two faults. A fault
    that restarts the job (kills, an emptied cache then a kill, a kill inside a checkpoint
    write) is recovered from when a new life of the process group completes a step; it
    must resume from the newest complete checkpoint on disk once the old life is gone (not
    from a half-written one). A stall or a bad link must not restart the job: it is
    recovered from when a step completes after it ended, in the same life. Whatever does
    not recover within ``HANG_S`` is a hang: the run stops there and says so. The times
    are the wall clock of this machine (the event logs' ``t``), which the nodes share.
"""

from __future__ import annotations

import random
import re
import signal
import time

from distcompile.runtime.checkpoint import latest_checkpoint

from .inject import empty_folder, kill, kill_during_write, link_fault, processes, signal_all
from .job import Job
from .monitor import Monitor
from .schedule import RESTARTING, Fault

__all__ = ["HANG_S", "Injector", "orphans", "stop_everything"]

#: Seconds after which a fault not recovered from counts as a hang.
HANG_S = 300.0


def _log(text: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {text}", flush=True)


class Injector:
    """Does the faults of a schedule to ``job`` and waits for each recovery.

    Example:
        >>> # inj = Injector(job, procs, seed=0); record = inj.fire(fault)
    """

    def __init__(self, job: Job, procs: list, *, seed: int) -> None:
        self.job, self.procs = job, procs
        self.mon = Monitor([job.events(n) for n in range(job.nodes)])
        self.rng = random.Random(seed + 1)
        self.recovered_at = 0  # the training step at the last recovery

    # -- what the job is doing -------------------------------------------------------
    def ended(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def _worker(self, node: int, local_rank: int) -> int | None:
        return next((p for p, lr in processes(self.job.tag, node=node).items() if lr == local_rank), None)

    def _rank0(self) -> int | None:
        life = self.mon.current()
        pid = life.pids.get(0) if life else None
        return pid if pid in processes(self.job.tag) else None

    def _newest_checkpoint(self) -> int | None:
        path = latest_checkpoint(self.job.ckpt_dir)
        return int(re.search(r"step-(\d+)\.pt$", path).group(1)) if path else None

    def wait_steps(self, step: int, timeout_s: float = HANG_S) -> bool:
        """Until the newest life has completed training step ``step`` (False: hang or job ended)."""

        def reached() -> bool:
            return (self.mon.last_step() or (0.0, -1))[1] >= step

        self.mon.wait(lambda: reached() or self.ended(), timeout_s)
        return reached()

    # -- one fault -------------------------------------------------------------------
    def fire(self, fault: Fault) -> dict:
        """Wait for ``fault``'s step, do it, wait for the recovery; its record."""
        rec: dict = {"index": fault.index, "kind": fault.kind, "node": fault.node, "worker": fault.worker}
        if not self.wait_steps(self.recovered_at + fault.gap):
            return {**rec, "outcome": "the job ended or stopped making progress before this fault"}
        self.mon.poll()
        life = self.mon.current()
        rec.update(step=self.mon.last_step()[1], life_before=life.life)
        getattr(self, f"_do_{fault.kind}")(fault, rec)
        _log(f"fault {fault.index + 1} {fault.kind} on node {fault.node} at step {rec['step']}: {rec['did']}")
        if fault.kind in RESTARTING:
            self._restarted(rec)
        else:
            self._continued(rec)
        _log(f"  -> {rec['outcome']}")
        return rec

    def _do_kill_worker(self, fault: Fault, rec: dict) -> None:
        pid = self._worker(fault.node, fault.worker)
        rec["t"] = time.time()
        rec["did"] = (
            f"SIGKILL local rank {fault.worker} (pid {pid})" if pid and kill(pid) else "no worker to kill"
        )

    def _do_empty_cache(self, fault: Fault, rec: dict) -> None:
        removed = empty_folder(self.job.cache(fault.node))
        self._do_kill_worker(fault, rec)
        rec["emptied_node"] = fault.node
        rec["did"] = f"emptied its cache folder ({removed} entries), then {rec['did']}"

    def _do_kill_in_checkpoint(self, fault: Fault, rec: dict) -> None:
        landed, tmp = kill_during_write(self.job.ckpt_dir, self._rank0, time.time() + HANG_S)
        rec["t"] = time.time()
        rec["landed_mid_write"] = landed
        rec["did"] = (
            f"SIGKILL rank 0 while it wrote {tmp} (left half-written)"
            if landed
            else f"SIGKILL rank 0 as {tmp or 'a checkpoint'} was written (the write had just ended)"
        )

    def _do_kill_node_compiling(self, fault: Fault, rec: dict) -> None:
        other = (fault.node + 1 + self.rng.randrange(self.job.nodes - 1)) % self.job.nodes
        trigger = self._worker(other, 0)
        rec["t"] = time.time()
        kill(trigger or 0)
        before = rec["life_before"]
        # The new life: wait for the node's workers' start, then kill them inside their first step.
        started = self.mon.wait(
            lambda: (
                (lf := self.mon.current()).life != before
                and len(set(lf.pids.values()) & set(processes(self.job.tag, node=fault.node)))
                == self.job.ranks_per_node
            ),
            HANG_S,
        )
        time.sleep(self.rng.uniform(0.2, 1.5))
        self.mon.poll()
        compiling = started and not self.mon.current().steps
        victims = list(processes(self.job.tag, node=fault.node))
        signal_all(victims)
        rec["life_before"] = self.mon.current().life
        rec["during_first_compile"] = compiling
        rec["did"] = (
            f"SIGKILL node {other}'s local rank 0 (pid {trigger}) for a restart, then all {len(victims)} workers "
            f"of node {fault.node} {'before' if compiling else 'after'} their first step (after wrap: loading the "
            "checkpoint, compiling or loading pieces)"
        )

    def _do_stall(self, fault: Fault, rec: dict) -> None:
        pid = self._worker(fault.node, fault.worker) or 0
        rec["t"] = time.time()
        kill(pid, signal.SIGSTOP)
        time.sleep(fault.seconds)
        kill(pid, signal.SIGCONT)
        rec["ended"] = time.time()
        rec["did"] = f"SIGSTOP local rank {fault.worker} (pid {pid}) for {fault.seconds:.0f} s, then SIGCONT"

    def _do_bad_link(self, fault: Fault, rec: dict) -> None:
        ns, dev = self.job.namespaces[fault.node], self.job.devices[fault.node]
        first = rec["step"]
        what = link_fault(ns, dev, True)
        rec["t"] = time.time()
        try:  # for its seconds, or until it has seen ``gap`` steps (the schedule allows that many)
            self.mon.wait(
                lambda: (self.mon.last_step() or (0, first))[1] - first >= fault.gap, fault.seconds, 0.2
            )
        finally:
            link_fault(ns, dev, False)
        rec["ended"] = time.time()
        self.mon.poll()
        rec["steps_during"] = (self.mon.last_step() or (0, first))[1] - first
        rec["did"] = (
            f"{what} on its link for {rec['ended'] - rec['t']:.1f} s (at most {fault.seconds:.0f} s or "
            f"{fault.gap} steps; {rec['steps_during']} steps meanwhile)"
        )

    # -- recovery --------------------------------------------------------------------
    def _restarted(self, rec: dict) -> None:
        before = rec["life_before"]
        if (
            not self.mon.wait(lambda: self.mon.current().life != before or self.ended(), HANG_S)
            or self.ended()
        ):
            rec["outcome"] = "hang: no new life of the process group" if not self.ended() else "the job ended"
            return
        expected = self._newest_checkpoint()  # the old life is gone: nothing writes now
        if not self.mon.wait(lambda: bool(self.mon.current().steps) or self.ended(), HANG_S):
            rec["outcome"] = "hang: the new life completed no step"
            return
        life = self.mon.current()
        first_t, first_step = life.steps[0]
        rec.update(
            recovered=True,
            life_after=life.life,
            resumed=life.resumed,
            expected_resume=expected,
            recomputed=max(0, rec["step"] - (life.resumed if life.resumed is not None else -1)),
            fault_to_step_s=round(first_t - rec["t"], 2),
            fault_to_start_s=round(life.started - rec["t"], 2),  # the processes' restart
            compiled_here=dict(life.compiled_here),
            resumed_newest=life.resumed == expected,
        )
        self.recovered_at = first_step
        rec["outcome"] = (
            f"new life resumed from step {life.resumed} (newest complete: {expected}), first step "
            f"{rec['fault_to_step_s']:.1f} s after the fault, {rec['recomputed']} step(s) recomputed, "
            f"pieces compiled per node: {rec['compiled_here'] or 'none'}"
        )

    def _continued(self, rec: dict) -> None:
        ended = rec["ended"]
        if not self.mon.wait(lambda: (self.mon.last_step() or (0, 0))[0] > ended or self.ended(), HANG_S):
            rec["outcome"] = "hang: no step after the fault ended"
            return
        life = self.mon.current()
        after = [s for s in life.steps if s[0] > ended]
        if not after:
            rec["outcome"] = "the job ended before a step after the fault"
            return
        t, step = after[0]
        same = life.life == rec["life_before"]
        rec.update(recovered=same, fault_to_step_s=round(t - rec["t"], 2), restarted=not same)
        self.recovered_at = step
        rec["outcome"] = (
            f"training went on in the same life: step {step} {t - rec['t']:.1f} s after the fault began"
            if same
            else "the job restarted: a stall or a slow link was taken for a failure"
        )


def orphans(tag: str) -> list[int]:
    """Processes of run ``tag`` still alive (after the job ended: there should be none).

    Example:
        >>> orphans("no-such-run")
        []
    """
    return sorted(processes(tag, workers_only=False))


def stop_everything(tag: str, job: Job) -> None:
    """Kill every process of run ``tag`` (stopped ones are continued first) and clear the links."""
    pids = orphans(tag)
    signal_all(pids, signal.SIGCONT)
    signal_all(pids, signal.SIGKILL)
    for ns, dev in zip(job.namespaces, job.devices):
        try:
            link_fault(ns, dev, False)
        except Exception:  # noqa: BLE001 - no netem there: nothing to clear
            pass
