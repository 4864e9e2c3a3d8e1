#!/usr/bin/env bash
# A single-host Slurm cluster for testing `dtrain slurm` against the real thing (root only).
#
#   scripts/slurm_cluster.sh up       install Slurm + munge if missing, start munged, slurmctld, slurmd
#   scripts/slurm_cluster.sh status   daemons, node state, queue
#   scripts/slurm_cluster.sh env      prints `export SLURM_CONF=...` (eval it to use sbatch/squeue/sacct -c)
#   scripts/slurm_cluster.sh down     cancel this cluster's jobs, stop its daemons, delete its state
#   scripts/slurm_cluster.sh purge    down, then remove the packages `up` installed (and only those)
#
# Everything lives under one directory it owns, $DTRAIN_SLURM_DIR (default /var/tmp/dtrain-slurm): its own
# slurm.conf, munge key and socket, state, spool, logs and pid files. Nothing under /etc is written and no
# system service is started, so a site Slurm or munge on the same machine is left alone (this cluster uses
# its own ports, 16817/16818 by default, and its own munge socket). Packages that `up` had to install are
# recorded in $DIR/installed-packages, so that `purge` removes exactly those; `down` keeps that record.
# There may be no systemd (containers): the daemons are started directly and tracked by their pid files.
#
# The node is this machine, with the CPUs and RealMemory `slurmd -C` reports; partition "dtrain" (default).
# DTRAIN_SLURM_NODES=N (N > 1, read by `up` when it writes the config) runs N slurmd on this host as nodes
# HOST-1..HOST-N (Debian builds Slurm with multiple-slurmd), each claiming the whole machine: multi-node
# jobs then run for real through srun, on one machine's CPUs and loopback.
# Accounting has no database: job completions go to jobcomp/filetxt, read with `sacct -c`.
set -euo pipefail

DIR=${DTRAIN_SLURM_DIR:-/var/tmp/dtrain-slurm}
CTLD_PORT=${DTRAIN_SLURM_PORT:-16817}
SLURMD_PORT=$((CTLD_PORT + 1))
NODES=${DTRAIN_SLURM_NODES:-1}
PACKAGES=(munge slurm-client slurmctld slurmd)
CONF=$DIR/etc/slurm.conf
MARK=$DIR/.dtrain-slurm  # says "this directory is ours": down refuses to delete a directory without it
export SLURM_CONF=$CONF

die() { echo "slurm_cluster: $*" >&2; exit 1; }
say() { echo "slurm_cluster: $*"; }

need_root() { [[ $(id -u) -eq 0 ]] || die "needs root (it installs packages and runs slurmd as root)"; }

# ----------------------------------------------------------------------------------- packages

install_missing() {
    local missing=() pkg
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get to install it (${missing[*]})"
    say "installing ${missing[*]} (apt-get)"
    local before after
    before=$(dpkg-query -W -f='${Package}\n' | sort)
    # The packages' maintainer scripts would start the system's munge/slurm services (on /etc configs we do
    # not use); a policy-rc.d that denies it is added for the install only, when the machine has none.
    local policy=/usr/sbin/policy-rc.d added_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\n# temporary, scripts/slurm_cluster.sh: no service starts during its apt-get install\nexit 101\n' \
            >"$policy"
        chmod 755 "$policy"
        added_policy=1
    fi
    local rc=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
        >"$DIR/log/apt-install.log" 2>&1 || rc=$?
    [[ $added_policy -eq 1 ]] && rm -f "$policy"
    [[ $rc -eq 0 ]] || die "apt-get install failed (see $DIR/log/apt-install.log; run 'apt-get update' first?)"
    after=$(dpkg-query -W -f='${Package}\n' | sort)
    # Everything new, dependencies included: purge removes exactly these.
    comm -13 <(echo "$before") <(echo "$after") >>"$DIR/installed-packages"
}

# ------------------------------------------------------------------------------------ config

write_config() {
    [[ -f $CONF ]] && return 0
    local node line cpus mem nodeline
    node=$(hostname -s)
    # `slurmd -C` prints this machine's real layout: "NodeName=vm CPUs=2 Boards=1 ... RealMemory=24105".
    line=$(slurmd -C | head -n 1)
    [[ $line == NodeName=* ]] || die "slurmd -C printed no node line: $line"
    cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$line")
    mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$line")
    [[ $NODES =~ ^[1-9][0-9]*$ ]] || die "DTRAIN_SLURM_NODES=$NODES: expected a node count"
    if [[ $NODES -eq 1 ]]; then
        nodeline="NodeName=$node"
    else
        nodeline="NodeName=$node-[1-$NODES] NodeHostname=$node NodeAddr=$node Port=$SLURMD_PORT-$((SLURMD_PORT + NODES - 1))"
    fi
    mungekey --create --keyfile="$DIR/munge/munge.key" --force
    chmod 600 "$DIR/munge/munge.key"
    : >"$DIR/etc/plugstack.conf"  # no site SPANK plugins from /etc/slurm
    cat >"$CONF" <<EOF
# Written by dtrain's scripts/slurm_cluster.sh for a single-host test cluster; deleted by 'down'.
ClusterName=dtrain
SlurmctldHost=$node
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
PlugStackConfig=$DIR/etc/plugstack.conf
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# No cgroups to set up (containers often have none writable): processes are tracked through /proc.
# task/affinity binds each task to the CPUs it was given, as most clusters do (so a job that asks for
# too few CPUs shows it here too).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# Slurm's defaults, written out because the scancel check relies on them: SIGTERM, then SIGKILL 30 s later.
KillWait=30
# Completed jobs stay visible to 'scontrol show job' for 5 minutes.
MinJobAge=300
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
$nodeline CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=dtrain Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

# ----------------------------------------------------------------------------------- daemons

# The pid in $1's pid file when that process is alive and is $2 (a reused pid is not ours).
live_pid() {
    local file=$1 name=$2 pid
    [[ -f $file ]] || return 1
    pid=$(tr -dc 0-9 <"$file")
    [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$name" || return 1
    echo "$pid"
}

wait_for() {  # wait_for SECONDS COMMAND...: poll until COMMAND succeeds
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

# The last lines of a daemon's log, on one line (a failed `up` is followed by `down`, which deletes it).
log_tail() {
    tail -n 3 "$DIR/log/$1" 2>/dev/null | tr -s '\n' ' ' || true
    echo "($DIR/log/$1)"
}

start_daemons() {
    if ! live_pid "$DIR/run/munged.pid" munged >/dev/null; then
        # --force: munged refuses a root-owned socket directory it considers insecure otherwise.
        munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
            --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
        wait_for 10 test -S "$DIR/munge/munge.socket" || die "munged did not start: $(log_tail munged.log)"
    fi
    if ! live_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null; then
        slurmctld -f "$CONF"
        # A fatal error (a port in use, ...) ends slurmctld at once: stop waiting then.
        wait_for 30 ctld_settled || true
        scontrol ping >/dev/null 2>&1 || die "slurmctld did not answer: $(log_tail slurmctld.log)"
    fi
    local node
    for node in $(node_names); do
        live_pid "$DIR/run/slurmd-$node.pid" slurmd >/dev/null || slurmd -f "$CONF" -N "$node"
    done
    for node in $(node_names); do
        if ! wait_for 60 node_ready "$node"; then
            die "node $node did not become idle: $(scontrol show node "$node" | grep -E 'State|Reason' | tr -s ' ')" \
                "$(log_tail "slurmd-$node.log")"
        fi
    done
}

ctld_settled() {  # slurmctld answers, or said why it never will
    scontrol ping >/dev/null 2>&1 || grep -q "fatal:" "$DIR/log/slurmctld.log" 2>/dev/null
}

# The configured node names (HOST, or HOST-1..HOST-N), expanded from the config's NodeName= line.
node_names() {
    scontrol show hostnames "$(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$CONF")"
}

node_ready() {
    local state
    state=$(sinfo -h -n "$1" -o %T 2>/dev/null) || return 1
    case $state in
        idle* | mixed* | allocated*) return 0 ;;
        down* | drain*)  # e.g. left down by an earlier run of this same cluster
            scontrol update nodename="$1" state=resume >/dev/null 2>&1 || true
            return 1 ;;
        *) return 1 ;;
    esac
}

stop_pidfile() {  # stop_pidfile FILE NAME: SIGTERM, then SIGKILL after 10 s
    local pid
    pid=$(live_pid "$1" "$2") || return 0
    kill "$pid" 2>/dev/null || true
    # live_pid, not kill -0: where PID 1 does not reap (some containers) the daemon stays a zombie.
    if wait_for 10 bash -c "! tr '\\0' ' ' </proc/$pid/cmdline | grep -q $2"; then
        say "stopped $2 ($pid)"
    else
        kill -9 "$pid" 2>/dev/null || true
        say "killed $2 ($pid)"
    fi
}

# Processes of this cluster's jobs: they carry a SLURM_JOB_ID and the SLURM_CONF they inherited from
# sbatch (our own file). The daemons carry SLURM_CONF but no job id.
job_pids() {
    local pid vars
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        [[ $pid == "$$" ]] && continue
        vars=$({ tr '\0' '\n' </proc/"$pid"/environ; } 2>/dev/null) || continue
        grep -qxF "SLURM_CONF=$CONF" <<<"$vars" && grep -q '^SLURM_JOB_ID=' <<<"$vars" && echo "$pid"
    done
    return 0
}

# ---------------------------------------------------------------------------------- commands

cmd_up() {
    need_root
    if [[ -e $DIR && ! -e $MARK ]]; then
        die "$DIR exists but was not made by this script; set DTRAIN_SLURM_DIR to another path"
    fi
    mkdir -p "$DIR"/{etc,munge,ctld,spool,run,log}
    touch "$MARK"
    chmod 700 "$DIR/munge"
    install_missing
    write_config
    start_daemons
    say "up: $(sinfo -h -o '%P %D node(s) %c CPUs %T' | head -n 1); use it with: eval \"\$($0 env)\""
}

cmd_down() {
    if [[ ! -e $DIR ]]; then
        say "down: nothing to do ($DIR does not exist)"
        return 0
    fi
    [[ -e $MARK ]] || die "$DIR was not made by this script; not touching it"
    if live_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null; then
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            say "cancelling jobs: $(echo $jobs)"
            scancel $jobs 2>/dev/null || true
            wait_for 45 bash -c '[[ -z $(squeue -h -o %i 2>/dev/null) ]]' || say "jobs still listed after 45 s"
        fi
    fi
    local pidfile
    for pidfile in "$DIR"/run/slurmd-*.pid; do
        [[ -e $pidfile ]] && stop_pidfile "$pidfile" slurmd
    done
    stop_pidfile "$DIR/run/slurmctld.pid" slurmctld
    local left
    left=$(job_pids)
    if [[ -n $left ]]; then
        say "killing leftover job processes: $(echo $left)"
        kill -9 $left 2>/dev/null || true
    fi
    stop_pidfile "$DIR/run/munged.pid" munged
    if [[ -s $DIR/installed-packages ]]; then
        # Keep only the record of installed packages (purge needs it).
        find "$DIR" -mindepth 1 -maxdepth 1 ! -name installed-packages ! -name .dtrain-slurm -exec rm -rf {} +
        say "down: daemons stopped, state removed (packages installed by 'up' are kept; 'purge' removes them)"
    else
        rm -rf "$DIR"
        say "down: daemons stopped, $DIR removed"
    fi
}

cmd_purge() {
    need_root
    cmd_down
    [[ -e $DIR ]] || return 0
    if [[ -s $DIR/installed-packages ]]; then
        local pkgs
        mapfile -t pkgs <"$DIR/installed-packages"
        say "removing packages installed by 'up': ${pkgs[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get purge -y -q "${pkgs[@]}" >/dev/null
    fi
    rm -rf "$DIR"
    say "purge: done"
}

cmd_status() {
    local name pid want=2 up=0
    local daemons=(munged:munged slurmctld:slurmctld)
    if [[ -f $CONF ]]; then
        for name in $(node_names); do daemons+=("slurmd-$name:slurmd"); want=$((want + 1)); done
    fi
    for name in "${daemons[@]}"; do
        if pid=$(live_pid "$DIR/run/${name%%:*}.pid" "${name#*:}"); then
            echo "${name%%:*}: running ($pid)"
            up=$((up + 1))
        else
            echo "${name%%:*}: not running"
        fi
    done
    if [[ $up -gt 0 ]]; then
        sinfo 2>&1 || true
        squeue 2>&1 || true
    fi
    [[ $up -eq $want && -f $CONF ]]
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    purge) cmd_purge ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|status|env|purge" >&2; exit 2 ;;
esac
