#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for tests/slurm/test_slurm_job.py:
# munged, slurmctld and slurmd from Debian's slurm-wlm, with a minimal slurm.conf
# (one node with this machine's CPUs and memory, one partition, no cgroups, no
# accounting database), all running as root; and shellcheck, which the test
# lints the launch scripts with.
#
#   bash tests/slurm/setup_slurm.sh        # as root; exit 0 once `sinfo` shows the node idle
#
# System set-up, run by .ci/run (which then exports ENVPIPE_CI_SLURM=1) or by
# hand: the tests never run it, they only use a cluster that is up and skip
# otherwise, naming this command. It installs packages, writes /etc/munge and
# /etc/slurm and leaves three root daemons running.
#
# Idempotent and fast when the cluster is already up and shellcheck installed
# (no apt-get, no restart). Packages are installed only when missing
# (`apt-get update` once, then `apt-get install -y slurm-wlm munge shellcheck`).
#
# Exit status: 0 ready; 2 SLURM cannot be installed or started here (not root,
# no apt-get, no package), with the reason as the last line on stderr;
# 1 anything else (the daemons' logs are printed).
#
# Environment: ENVPIPE_SLURM_STATE (default /var/spool/envpipe-slurm: state,
# spool, pid and log files), ENVPIPE_SLURM_PARTITION (default debug),
# ENVPIPE_SLURM_WAIT (seconds to wait for the node, default 90).
set -euo pipefail

STATE=${ENVPIPE_SLURM_STATE:-/var/spool/envpipe-slurm}
PARTITION=${ENVPIPE_SLURM_PARTITION:-debug}
WAIT_S=${ENVPIPE_SLURM_WAIT:-90}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARKER="# written by megatron-envpipe tests/slurm/setup_slurm.sh"
export PATH="$PATH:/usr/sbin:/sbin"

log() { printf 'setup_slurm: %s\n' "$*"; }
cannot() { printf 'setup_slurm: cannot run SLURM here: %s\n' "$*" >&2; exit 2; }
fail() {
    printf 'setup_slurm: error: %s\n' "$*" >&2
    local f
    for f in "$STATE/slurmctld.log" "$STATE/slurmd.log" /var/log/munge/munged.log; do
        if [ -s "$f" ]; then
            printf -- '--- last lines of %s\n' "$f" >&2
            tail -n 25 "$f" >&2
        fi
    done
    exit 1
}

# The node name slurmd registers under (slurmd -C prints it too).
node_name() { hostname -s; }

node_state() {
    # First state of our node, lower case, without flags such as '*' (not responding).
    sinfo --noheader --node "$(node_name)" --format '%T' 2>/dev/null | head -n1 | tr -d '*~#!%$@^-' || true
}

cluster_ready() {
    command -v sinfo >/dev/null 2>&1 || return 1
    scontrol ping 2>/dev/null | grep -q 'UP' || return 1
    case "$(node_state)" in
        idle|mixed|allocated|completing) return 0 ;;
    esac
    return 1
}

# ---------------------------------------------------------------- fast path
if cluster_ready && command -v shellcheck >/dev/null 2>&1; then
    log "already up: node $(node_name) $(node_state) (sinfo), shellcheck installed, nothing to do"
    exit 0
fi

# ---------------------------------------------------------------- packages
if [ "$(id -u)" -ne 0 ]; then
    cannot "not root (needs root to install slurm-wlm, munge and shellcheck and to start slurmctld/slurmd)"
fi
missing=()
for cmd in slurmctld slurmd sbatch munged; do
    if ! command -v "$cmd" >/dev/null 2>&1; then
        missing=(slurm-wlm munge)
    fi
done
if ! command -v shellcheck >/dev/null 2>&1; then
    missing+=(shellcheck)
fi
if [ "${#missing[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 || cannot "${missing[*]} not installed and there is no apt-get to install them"
    export DEBIAN_FRONTEND=noninteractive
    log "installing ${missing[*]} (apt-get)"
    apt-get update -qq >/dev/null 2>&1 || cannot "apt-get update failed (no package repository reachable?)"
    # No service is started by the packages' scripts here: there is no init
    # system in a container, and we start the daemons ourselves below.
    if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >"${TMPDIR:-/tmp}/envpipe-slurm-apt.log" 2>&1; then
        tail -n 20 "${TMPDIR:-/tmp}/envpipe-slurm-apt.log" >&2
        cannot "apt-get install ${missing[*]} failed (log above)"
    fi
    for cmd in slurmctld slurmd sbatch munged shellcheck; do
        command -v "$cmd" >/dev/null 2>&1 || cannot "$cmd not found after installing ${missing[*]}"
    done
fi
if cluster_ready; then
    log "ready: node $(node_name) $(node_state) (sinfo), shellcheck installed"
    exit 0
fi

# ---------------------------------------------------------------- munge
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --force --keyfile /etc/munge/munge.key
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
fi
MUNGE_USER=root
if id munge >/dev/null 2>&1; then
    MUNGE_USER=munge
fi
chown -R "$MUNGE_USER:" /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged (as $MUNGE_USER)"
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    if [ "$MUNGE_USER" = root ]; then
        munged --force
    else
        runuser -u munge -- munged
    fi
    for _ in $(seq 50); do
        if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then break; fi
        sleep 0.1
    done
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 || fail "munged does not answer (munge -n | unmunge)"
fi

# ---------------------------------------------------------------- slurm.conf
NODE=$(node_name)
# slurmd -C: "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=23977"
HW=$(slurmd -C 2>/dev/null | grep '^NodeName=' | head -n1) || true
[ -n "$HW" ] || fail "slurmd -C printed no NodeName line"
HW=${HW#NodeName=* }  # the hardware fields only; the node name is ours
mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/d"
if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
    # Someone else's cluster configuration: use it as it is.
    log "using the existing $CONF (not written by this script)"
else
    NEW=$(cat <<EOF
$MARKER
# A one-node cluster on localhost for tests; rewritten whenever the script runs.
ClusterName=envpipe-test
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# Keep finished jobs in scontrol for an hour: there is no accounting database for sacct.
MinJobAge=3600
KillWait=30
SlurmctldTimeout=60
SlurmdTimeout=120
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$NODE NodeAddr=127.0.0.1 $HW State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
)
    if [ ! -e "$CONF" ] || [ "$(cat "$CONF")" != "$NEW" ]; then
        log "writing $CONF (node $NODE: $HW)"
        printf '%s\n' "$NEW" >"$CONF"
    fi
fi

# ---------------------------------------------------------------- daemons
# A daemon runs when its pid file names a live process of that name (a pid
# file left from an earlier boot may name some other process now).
running() {
    local pid
    pid=$(cat "$STATE/$1.pid" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ]
}
if ! running slurmctld; then
    log "starting slurmctld"
    slurmctld || fail "slurmctld did not start"
fi
if ! running slurmd; then
    log "starting slurmd"
    slurmd || fail "slurmd did not start"
fi

deadline=$(( $(date +%s) + WAIT_S ))
resumed=0
while :; do
    if cluster_ready; then
        log "ready: node $NODE $(node_state), partition $PARTITION ($(sinfo --version))"
        exit 0
    fi
    state=$(node_state)
    case "$state" in
        down|drained|draining|drain|fail|failing)
            if [ "$resumed" -eq 0 ]; then
                log "node $NODE is $state: resuming it"
                scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
                resumed=1
            fi
            ;;
    esac
    if [ "$(date +%s)" -ge "$deadline" ]; then
        sinfo >&2 || true
        scontrol show node "$NODE" >&2 || true
        fail "node $NODE not idle after ${WAIT_S}s (state: ${state:-unknown})"
    fi
    sleep 0.5
done
