#!/usr/bin/env bash
# CI only: the launchers the scaling issue runs for real (tests/benchmarks/test_launchers.py):
# a one-node slurm (munge, slurmctld and slurmd on this host, as root, no systemd) and Open MPI,
# with mpi4py in the test venv.  Exits 0 when all of it runs (.ci/run then makes the tests
# required: FORGE_DIST_REQUIRE_LAUNCHERS=1), else prints what is missing and exits 1 (a host
# that cannot install Debian packages as root: the tests skip, saying why).
set -uo pipefail
cd "$(dirname "$0")/.."
log=/tmp/forge_dist_launchers.log
say() { echo "launchers: $*"; }

if ! command -v sbatch >/dev/null || ! command -v mpirun >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  { timeout 300 apt-get update -qq && timeout 600 apt-get install -y -qq --no-install-recommends \
      slurm-wlm munge openmpi-bin libopenmpi-dev; } >> "$log" 2>&1 || say "apt-get failed (see $log)"
fi

# munge: the key, then the daemon as its own user
if command -v munged >/dev/null; then
  mkdir -p /etc/munge /var/log/munge /var/lib/munge /run/munge
  [ -f /etc/munge/munge.key ] || mungekey -c -f -k /etc/munge/munge.key >> "$log" 2>&1
  chown -R munge:munge /etc/munge /var/log/munge /var/lib/munge /run/munge
  chmod 400 /etc/munge/munge.key
  pgrep -x munged >/dev/null || su -s /bin/sh munge -c munged >> "$log" 2>&1 || say "munged did not start"
fi

# slurm: one node (this host, its cores), one partition that oversubscribes
if command -v slurmctld >/dev/null; then
  host=$(hostname -s)
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  cat > /etc/slurm/slurm.conf <<CONF
ClusterName=ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
  pgrep -x slurmctld >/dev/null || slurmctld >> "$log" 2>&1 || say "slurmctld did not start"
  pgrep -x slurmd >/dev/null || slurmd >> "$log" 2>&1 || say "slurmd did not start"
  for _ in $(seq 30); do timeout 5 sinfo -h -o %t 2>/dev/null | grep -q idle && break; sleep 1; done
  timeout 10 sinfo -h -o "%P %t %D" 2>/dev/null | sed 's/^/launchers: slurm partition /'
fi

# mpi4py in the venv the README's test command creates next (it keeps an existing venv)
python3 -m venv .venv && .venv/bin/pip install -q "mpi4py>=3.1" >> "$log" 2>&1 || say "mpi4py did not install"

missing=()
timeout 20 sinfo -h -o %t 2>/dev/null | grep -qE "idle|mix" || missing+=("a running slurm")
command -v mpirun >/dev/null || missing+=("mpirun")
.venv/bin/python -c "import mpi4py" 2>/dev/null || missing+=("mpi4py")
if [ ${#missing[@]} -gt 0 ]; then
  say "not set up: ${missing[*]} (see $log)"
  exit 1
fi
say "slurm and Open MPI are up"
