"""The exit -6 of issue 43: a Fabric run that ended with ``terminate called without an active exception`` after its
last step, about once in ten runs.

The cause: a daemon thread inside a c10d call (the fault guard's heartbeat, writing to the rendezvous store with the
GIL released) when the interpreter finalizes. When the call returns, the thread asks for the GIL, Python ends it
with ``pthread_exit``, and unwinding that through C++ (pybind11's GIL guard, a destructor) calls ``std::terminate``:
SIGABRT, after a successful run.

Made deterministic here, in a fresh interpreter each (finalization is the subject): the heartbeat's store answers
late (each operation waits 1.5 s in a real c10d call, as a loaded or vanished store does) and the interpreter takes
3 s to finalize. Without the exit hook the process aborts; with the one Fabric's strategy registers
(``Job.start_for_loop`` -> ``register_exit``; at exit ``leave_at_exit`` -> ``Job.leave`` joins the heartbeat) it
exits 0. The repeated runs of the real job, before and after: docs/fabric.md.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.distributed  # a fresh interpreter per case

SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_sgdtp.runtime.faults import Liveness

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    inside = threading.Event()


    class LateStore:
        # every operation first waits 1.5 s in c10d (the GIL released), then does what was asked
        def __init__(self, store):
            self.store, self.server = store, server  # the server lives as long as the thread's client

        def late(self):
            if threading.current_thread() is not threading.main_thread():
                inside.set()
            try:
                self.store.wait(["never"], timedelta(seconds=1.5))
            except Exception:
                pass

        def set(self, key, value):
            self.late()
            self.store.set(key, value)

        def add(self, key, n):
            self.late()
            return self.store.add(key, n)


    real_client = Liveness._client
    Liveness._client = lambda self: LateStore(real_client(self))
    live = Liveness("127.0.0.1", server.port, 0, 2, "exit", collective_timeout=1.0)
    live.start()
    if sys.argv[1] == "hook":  # what Fabric's strategy registers at setup (Job.start_for_loop)
        from lightning_sgdtp.frontends import job as jobs
        from lightning_sgdtp.frontends.fabric import SGDTPFabricStrategy

        job = SGDTPFabricStrategy()._job
        job.guard.liveness = live
        jobs.register_exit(job)
    inside.wait()  # the heartbeat thread is in a store operation now


    class SlowToFinalize:
        def __del__(self, sleep=time.sleep):  # no global lookup: the module's names are gone by then
            sleep(3)


    sys.modules["_slow_to_finalize"] = SlowToFinalize()  # freed once the interpreter finalizes
    print("trained", flush=True)
    """
)


def test_a_heartbeat_in_a_store_call_at_exit_aborts_unless_the_exit_hook_joins_it() -> None:
    runs = {
        case: subprocess.Popen(
            [sys.executable, "-c", SCRIPT, case], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for case in ("bare", "hook")
    }
    done = {case: (proc.communicate(timeout=120), proc.returncode) for case, proc in runs.items()}
    (out, err), rc = done["bare"]  # the negative control: the failure this test guards against
    assert rc == -6 and "terminate called without an active exception" in err, (rc, err[-2000:])
    (out, err), rc = done["hook"]
    assert rc == 0 and "trained" in out and "terminate called" not in err, (rc, err[-2000:])
