"""Fresh processes without the import: a parent interpreter (the zygote) imports torch, Lightning and
lightning_sgdtp once; each script then runs in a process forked from it, as ``python SCRIPT`` would run it.

Why: importing those three costs about 5 s of CPU per interpreter on the 2-core CI machine, and the docs have some
sixty blocks, most of which run in well under a second once imported (issue 22: the docs file was the suite's
largest). A forked child is a new process with its own session (its whole process group is killed on timeout),
its own stdout/stderr, ``sys.argv = [SCRIPT]``, ``sys.path[0]`` the script's folder, ``__name__ == "__main__"``,
the environment it is given, and a normal interpreter exit (atexit handlers, exit status, an uncaught exception's
traceback on stderr, status 1). What it shares with its siblings is only what importing those modules left in
memory, the state every script that imports them starts from. Launchers inside a script (Lightning's, which runs
``sys.executable SCRIPT`` again for each rank; ``torch.multiprocessing.spawn``) start ordinary fresh interpreters.

The zygote is single-threaded in Python and never imports anything after it starts forking; it reports each
child's exit status on its stdout, one JSON line each (``{"id": .., "pid": ..}`` when forked, ``{"id": ..,
"rc": ..}`` when reaped, negative for a signal, like ``subprocess``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

from helpers import REPO

SERVER = r"""
import importlib, json, os, select, signal, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
# Inductor's choice of vector ISA builds and loads a probe library (a torch import in a subprocess) once per
# process: made here, once, for this machine and this environment.
from torch._inductor.cpu_vec_isa import pick_vec_isa

pick_vec_isa()
del pick_vec_isa


def serve():
    # Returns only in a forked child, with what to run.
    children = {}
    pending = b""
    print(json.dumps({"ready": True}), flush=True)
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:  # the test side closed the pipe: end, killing whatever still runs
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os._exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    return request
                children[pid] = request["id"]
                print(json.dumps({"id": request["id"], "pid": pid}), flush=True)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            print(json.dumps({"id": children.pop(pid), "rc": rc}), flush=True)


request = serve()
os.setsid()
out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
err = out if request["stderr"] is None else os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
null = os.open(os.devnull, os.O_RDONLY)
for fd, new in ((0, null), (1, out), (2, err)):
    os.dup2(new, fd)
for new in {null, out, err}:
    os.close(new)
os.environ.clear()
os.environ.update(request["env"])
os.chdir(request["cwd"])
argv = request["argv"]
del serve, request, importlib, select, signal, out, err, null
import runpy, types
if argv[0] == "-m":  # python -m MODULE ARGS
    sys.argv = argv[1:]
    sys.path[0] = os.getcwd()
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
elif argv[0] == "-c":  # python -c CODE ARGS
    sys.argv = ["-c", *argv[2:]]
    sys.path[0] = ""
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    exec(compile(argv[1], "<string>", "exec"), main.__dict__)
else:  # python SCRIPT ARGS
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")
"""

#: What every job imports: the three packages, and what their first compile imports (Inductor's lowering and C++
#: code generation, AOTAutograd, DTensor, pipelining, DCP), measured as the modules a one-process sgdtp fit loads.
PRELOAD = (
    "torch",
    "lightning.pytorch",
    "lightning_sgdtp",
    "torch._dynamo.backends.common",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "torch._inductor.async_compile",
    "torch._inductor.codecache",
    "torch._inductor.codegen.cpp",
    "torch._inductor.codegen.cpp_wrapper_cpu",
    "torch._inductor.compile_fx",
    "torch._inductor.cpp_builder",
    "torch._inductor.decomposition",
    "torch._inductor.fx_passes.joint_graph",
    "torch._inductor.fx_passes.post_grad",
    "torch._inductor.fx_passes.pre_grad",
    "torch._inductor.graph",
    "torch._inductor.kernel.mm",
    "torch._inductor.lowering",
    "torch._inductor.scheduler",
    "torch._inductor.select_algorithm",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch.utils.cpp_extension",
)


class Zygote:
    """Run scripts in processes forked from one interpreter that has imported ``PRELOAD``; thread-safe."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = PRELOAD) -> None:
        self.env = dict(env)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, *preload],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        ready = self._proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the zygote did not start (rc={self._proc.wait()})")
        self._lock = threading.Lock()
        self._count = 0
        self._pids: dict[str, Future[int]] = {}
        self._rcs: dict[str, Future[int]] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            event = json.loads(line)
            with self._lock:
                if "pid" in event:
                    self._pids[event["id"]].set_result(event["pid"])
                else:
                    self._rcs[event["id"]].set_result(event["rc"])
        with self._lock:  # the zygote ended: nothing pending will ever be answered
            for future in [*self._pids.values(), *self._rcs.values()]:
                if not future.done():
                    future.set_exception(RuntimeError(f"the zygote ended (rc={self._proc.poll()})"))

    def run(
        self, argv: list[str], env: dict[str, str], timeout: float, merge_stderr: bool = False
    ) -> tuple[int, str, str, bool]:
        """Run ``python ARGV`` (``SCRIPT ARGS``, ``-m MODULE ARGS`` or ``-c CODE ARGS``; cwd = the repository root) to
        its end or ``timeout`` s, then kill its whole process group.

        Returns (exit status, stdout, stderr: "" when merged into stdout, timed_out)."""
        with tempfile.TemporaryDirectory(prefix="sgdtp-zygote-") as tmp:
            out, err = Path(tmp) / "stdout", None if merge_stderr else Path(tmp) / "stderr"
            with self._lock:
                self._count += 1
                key = str(self._count)
                self._pids[key], self._rcs[key] = Future(), Future()
                request = {"id": key, "argv": argv, "env": env, "cwd": str(REPO)}
                request.update(stdout=str(out), stderr=None if err is None else str(err))
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
            pid = self._pids[key].result(timeout=60)
            timed_out = False
            try:
                rc = self._rcs[key].result(timeout=timeout)
            except TimeoutError:
                timed_out = True
                os.kill(pid, signal.SIGKILL)  # also before its setsid
            try:  # the child's session: the script, its ranks, their compile workers
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if timed_out:
                rc = self._rcs[key].result(timeout=60)
            with self._lock:
                del self._pids[key], self._rcs[key]
            stderr = "" if err is None else err.read_text(errors="replace")
            return rc, out.read_text(errors="replace"), stderr, timed_out

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # the zygote kills its children and exits
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()
        self._reader.join(timeout=10)
