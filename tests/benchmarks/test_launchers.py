"""Launch scripts (bash -n, DRY_RUN lines, task counts) and forge_dist.launch_env."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forge_dist import launch_env

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(list((REPO / "slurm").glob("*.sbatch")) + list((REPO / "slurm").glob("*.sh"))
                 + list((REPO / "launch").glob("*.sh")))


def _bash(args, **env):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "OMPI_", "PMI_")) and k not in (
                 "MASTER_ADDR", "MASTER_PORT", "NODES", "GPUS_PER_NODE", "RANK", "WORLD_SIZE")}
    clean["PYTHON"] = sys.executable
    clean.update(env)
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=60,
                          env=clean, cwd=REPO)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _srun(out):
    lines = [ln for ln in out.splitlines() if " srun " in f" {ln} " or ln.startswith("+ srun")]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.parametrize("nodes,per_node", [(1, 8), (4, 8), (16, 8), (1, 2)])
def test_weak_scaling_dry_run_task_counts(nodes, per_node):
    proc = _bash(["slurm/weak_scaling.sbatch", "--set", "repeats=3"], DRY_RUN="1",
                 NODES=str(nodes), GPUS_PER_NODE=str(per_node))
    assert proc.returncode == 0, proc.stderr
    line = _srun(proc.stdout)
    assert f"--ntasks={nodes * per_node} " in line and f"--nodes={nodes} " in line
    assert f"--ntasks-per-node={per_node} " in line
    assert "scaling_benchmarks/weak_scaling.py --config" in line and line.endswith("repeats=3")
    assert "cost_model.py" in proc.stdout and "--calibrate" in proc.stdout


def test_slurm_environment_gives_master_and_geometry():
    proc = _bash(["slurm/train.sbatch", "--set", "steps=5"], DRY_RUN="1",
                 SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="8(x2)",
                 SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_ID="123457")
    assert proc.returncode == 0, proc.stderr
    line = _srun(proc.stdout)
    assert "--ntasks=16 " in line and "launch/train.py --config" in line
    assert "MASTER_PORT=23457" in line
    if shutil.which("scontrol") is None:  # our parser stands in for scontrol
        assert "MASTER_ADDR=gpu07 " in line


def test_mpirun_launcher():
    proc = _bash(["slurm/train.sbatch"], DRY_RUN="1", NODES="2", LAUNCHER="mpirun")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"mpirun -np 16 --map-by ppr:8:node", proc.stdout)
    bad = _bash(["slurm/train.sbatch"], DRY_RUN="1", LAUNCHER="ssh")
    assert bad.returncode != 0 and "LAUNCHER must be" in bad.stderr


def test_sweep_submits_one_job_per_node_count():
    proc = _bash(["slurm/sweep_weak_scaling.sh", "1", "2", "4", "--", "--set", "repeats=2"],
                 DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("+ sbatch")]
    assert [re.search(r"--nodes=(\d+)", ln).group(1) for ln in lines] == ["1", "2", "4"]
    assert "--dependency" not in lines[0] and all("--dependency" in ln for ln in lines[1:])


def test_torchrun_wrapper():
    proc = _bash(["launch/torchrun.sh", "--nnodes", "2", "--node-rank", "1",
                  "--rdzv-endpoint", "n1:29400", "--nproc-per-node", "8", "x.py", "--a"],
                 DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "NCCL_NVLS_ENABLE=0" in out and "NVSHMEM_DISABLE_NVLS=1" in out
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in out
    assert "--nproc_per_node 8 --nnodes 2 --node_rank 1 --rdzv_backend c10d" in out
    assert out.strip().endswith("x.py --a")
    single = _bash(["launch/torchrun.sh", "--nproc-per-node", "2", "y.py"], DRY_RUN="1")
    assert "--standalone" in single.stdout
    missing = _bash(["launch/torchrun.sh", "--nnodes", "2", "x.py"], DRY_RUN="1")
    assert missing.returncode == 2 and "rdzv-endpoint" in missing.stderr
    kept = _bash(["launch/torchrun.sh", "y.py"], DRY_RUN="1", NCCL_NVLS_ENABLE="1")
    assert "NCCL_NVLS_ENABLE=1" in kept.stdout  # an explicit user choice is kept


def test_run_weak_scaling_dry_run():
    proc = _bash(["launch/run_weak_scaling.sh", "--nproc-per-node", "2", "--", "--set",
                  "repeats=1"], DRY_RUN="1", OUT="/tmp/x")
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()
    assert "--nproc_per_node 2" in first and "--out /tmp/x --set repeats=1" in first
    assert "cost_model.py" in second and "/tmp/x/weak_scaling_*_ws*.json" in second


# -- launch_env ------------------------------------------------------------------------------

def test_detect_sources():
    d = launch_env.detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
                           "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (d.rank, d.world_size, d.local_rank, d.node_rank, d.source) == (3, 8, 3, 0, "torchrun")
    d = launch_env.detect({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                           "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_NODELIST": "a[3-4]",
                           "SLURM_JOB_ID": "5"}, use_mpi4py=False)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size, d.node_rank) == \
        (9, 16, 1, 8, 1)
    assert d.master_port == 20005 and d.source == "slurm"
    if shutil.which("scontrol") is None:
        assert d.master_addr == "a3"
    d = launch_env.detect({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                           "MASTER_ADDR": "m"}, use_mpi4py=False)
    assert (d.rank, d.world_size, d.local_rank, d.master_addr, d.source) == (5, 6, 1, "m", "ompi")
    d = launch_env.detect({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0",
                           "MASTER_ADDR": "m"}, use_mpi4py=False)
    assert (d.rank, d.world_size, d.source) == (2, 4, "pmi")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        launch_env.detect({"PMI_RANK": "0", "PMI_SIZE": "2"}, use_mpi4py=False)
    d = launch_env.detect({}, use_mpi4py=False)
    assert (d.rank, d.world_size, d.source) == (0, 1, "single")
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        launch_env.detect({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, use_mpi4py=False)


@pytest.mark.parametrize("nodelist,hosts", [
    ("node01", ["node01"]),
    ("gpu[07-09]", ["gpu07", "gpu08", "gpu09"]),
    ("a[1,3-4],b[09-10]", ["a1", "a3", "a4", "b09", "b10"]),
    ("r[1-2]n[5-6]", ["r1n5", "r1n6", "r2n5", "r2n6"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert launch_env.expand_nodelist(nodelist) == hosts


def test_export_round_trip():
    info = launch_env.LaunchInfo(4, 8, 0, 4, "host", 1234, "slurm")
    env = {}
    launch_env.export(info, env)
    back = launch_env.detect(env, use_mpi4py=False)
    assert (back.rank, back.world_size, back.local_rank, back.master_addr, back.master_port) == \
        (4, 8, 0, "host", 1234)


# --- the launchers for real (CI sets them up: .ci/launchers.sh) -----------------------------
def _launcher_missing(*commands: str) -> str:
    """Why a real launch cannot run here ("" if it can); CI (FORGE_DIST_REQUIRE_LAUNCHERS=1)
    fails instead of skipping."""
    missing = [c for c in commands if shutil.which(c) is None]
    if not missing and "sinfo" in commands:
        try:
            up = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                                timeout=30)
        except subprocess.TimeoutExpired:
            up = subprocess.CompletedProcess([], 1, "", "sinfo did not answer in 30 s")
        if up.returncode != 0 or "idle" not in up.stdout and "mix" not in up.stdout:
            missing.append(f"a running slurm (sinfo: {up.stdout.strip() or up.stderr.strip()})")
    if not missing and "mpirun" in commands:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            missing.append("mpi4py")
    reason = ", ".join(missing)
    if reason and os.environ.get("FORGE_DIST_REQUIRE_LAUNCHERS") == "1":
        pytest.fail(f"FORGE_DIST_REQUIRE_LAUNCHERS=1 but missing: {reason} "
                    "(/tmp/forge_dist_launchers.log has .ci/launchers.sh's output)")
    return reason


def test_weak_scaling_sbatch_runs_on_a_one_node_slurm(tmp_path):
    """``slurm/weak_scaling.sbatch`` through sbatch and srun, 2 CPU tasks (``--gpus-per-node=0``,
    as a CPU-only cluster runs it; launch/README.md): the tasks find each other from slurm's
    variables and write their rows."""
    import json

    reason = _launcher_missing("sbatch", "sinfo")
    if reason:
        pytest.skip(f"no slurm here: {reason}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    env.update(PYTHON=sys.executable, PYTHONPATH=str(REPO), OUT=str(tmp_path), COST_MODEL="0",
               FORGE_DIST_TIMEOUT="60")
    proc = subprocess.run(
        ["sbatch", "--wait", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
         "--no-requeue", f"--output={tmp_path}/job-%j.out", "--export=ALL",
         str(REPO / "slurm" / "weak_scaling.sbatch"), "--cpu", "--set", "tokens_per_gpu=64",
         "--set", "repeats=1", "--set", "warmup=1", "--set", "state_pass=false",
         "--ops", "simple_gla", "--modes", "fwd", "--strategies", "serial,hier",
         "--tag", "slurm-ci"],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    logs = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs[-3000:]}"
    assert "srun --nodes=1 --ntasks=2" in logs
    rows = json.loads(next(tmp_path.glob("weak_scaling_*_slurm-ci_ws2.json")).read_text())["rows"]
    assert {(r["strategy"], r["world_size"]) for r in rows} == {("ideal", 1), ("serial", 2),
                                                               ("hier", 2)}


def test_mpirun_ranks_rendezvous_through_mpi4py(tmp_path):
    """``mpirun -np 2`` with no MASTER_ADDR: launch_env reads Open MPI's variables, mpi4py
    hands rank 0's host to rank 1, and a gloo group runs ``hier`` right."""
    import json

    reason = _launcher_missing("mpirun")
    if reason:
        pytest.skip(f"no Open MPI here: {reason}")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_")) and k not in (
               "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
               "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), FORGE_DIST_TIMEOUT="60")
    proc = subprocess.run(
        ["mpirun", "-np", "2", "--oversubscribe", "--allow-run-as-root", sys.executable,
         str(REPO / "tests" / "benchmarks" / "mpi_worker.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["source"], r["rank"], r["world"]) for r in reports] == [("ompi", 0, 2),
                                                                       ("ompi", 1, 2)]
    assert reports[0]["master"] == reports[1]["master"]
    assert all(r["ok"] for r in reports), reports
