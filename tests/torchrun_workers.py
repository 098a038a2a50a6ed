"""Launch a multi-GPU worker script under torchrun and collect its per-rank JSON reports.

The worker's lines go to the real stderr as they come (pytest's capture would hold them
until the end, and a killed run would show nothing) and are kept for the failure message.
Used by the ``multigpu`` tests (tests/sp/test_forge_multigpu.py,
tests/robustness/test_forge_gpu.py, tests/runtime/test_gpu.py,
tests/sp/test_strategies_nccl.py).

Every launch is ``--standalone``: the agent's store binds a port the OS picks (port 0), so
launches never share torchrun's fixed default port 29500 (a launch that found it taken, or
another job's store behind it, failed), and each gets its own rendezvous (and its own
``MASTER_PORT``, which names the forge sim's shared-memory segments).  Every rank's output
also goes to its own log under ``log_dir``: a failure message shows each rank's last lines,
where torchrun's own summary ("rank 0 ... exitcode 1", about 2,500 characters) used to push
the cause (a traceback, a watchdog's stack dump) out of the tail that was shown."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import List, Tuple

ROOT = Path(__file__).resolve().parents[1]
# NVLink multicast off everywhere (see docs/design.md, section 4)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
# what a test process may have set that must not reach a real GPU launch
_NOT_INHERITED = ("TRITON_INTERPRET", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                  "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def launch_env() -> dict:
    """The environment of a GPU launch: this one, with multicast off, the repository on
    ``PYTHONPATH``, and nothing of a rendezvous or the Triton interpreter."""
    env = dict(os.environ, **NO_MULTICAST, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    for key in _NOT_INHERITED:
        env.pop(key, None)
    return env


def torchrun(script: Path, args: List[str], world: int, log_dir: Path,
             timeout_s: float = 600) -> Tuple[int, List[str]]:
    """Run ``torchrun --standalone --nproc_per_node=world script *args``, streaming its
    lines to the real stderr; returns ``(returncode, lines)``.  Killed (returncode
    ``None``) after ``timeout_s``; the ranks' logs are in ``log_dir`` (:func:`rank_logs`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", f"--log-dir={log_dir}", "--tee=3",
           str(script)] + [str(a) for a in args]
    lines: List[str] = []
    # its own session: a timeout (or ^C) ends torchrun *and* its workers, so no rank of this
    # launch is left holding a GPU, its memory or a port when the next test starts
    with subprocess.Popen(cmd, env=launch_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True) as proc:
        def pump():
            for line in proc.stdout:
                lines.append(line)
                sys.__stderr__.write(line)
                sys.__stderr__.flush()
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:  # the wait is bounded even if a worker hangs with its output open
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _end(proc)
            reader.join(5)
            lines.append(f"[torchrun_workers] killed after {timeout_s:g}s\n")
            return None, lines
        except BaseException:
            _end(proc)
            raise
        reader.join(30)
    return proc.returncode, lines


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM to the launch's process group (torchrun stops its workers), then SIGKILL to
    whatever of it is left, so that no worker outlives the launch."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group is gone
        pass
    proc.wait()


def rank_logs(log_dir: Path, tail_chars: int = 3000) -> str:
    """Every rank's stderr and stdout tails from torchrun's ``--log-dir``, for a failure
    message (a rank that died shows its own traceback, not only torchrun's summary)."""
    parts = []
    for path in sorted(Path(log_dir).glob("*/attempt_*/*/std*.log")):
        text = path.read_text(errors="replace")
        if text.strip():
            rank = path.parent.name
            parts.append(f"--- rank {rank} {path.stem} (last {tail_chars} characters) ---\n"
                         f"{text[-tail_chars:]}")
    return "\n".join(parts) or f"(no rank logs under {log_dir})"


def run_workers(script: Path, out: Path, world: int, timeout_s: float = 600):
    """Run ``torchrun --nproc_per_node=world script out``; returns ``(reports, lines)``
    where ``reports[r]`` is ``out/rank<r>.json`` (an assertion names a missing one and
    shows every rank's log)."""
    log_dir = out / "torchrun_logs"
    rc, lines = torchrun(script, [out], world, log_dir, timeout_s)
    reports = {}
    for r in range(world):
        path = out / f"rank{r}.json"
        assert path.exists(), (f"rank {r} wrote no report; rc={rc}\n"
                               f"{''.join(lines)[-2000:]}\n{rank_logs(log_dir)}")
        reports[r] = json.loads(path.read_text())
    return reports, lines
