# shellcheck shell=bash
# The one body of EnvPipe's launch scripts, sourced by
#   examples/slurm/pretrain_gpt_envpipe.sbatch   (SLURM, any number of nodes)
#   examples/torchrun_single_node.sh             (one node, plain torchrun)
# Each launcher only says where the nodes, ranks and master come from
# (DISTRIBUTED_ARGS); everything else is here: every knob as an environment
# variable with a default, Megatron-LM's bash-array layout, and the per-node
# runner that resets GPU clocks when torchrun ends, however it ends.
#
# ENVPIPE_EXAMPLE picks what runs, with the same arrays and the same launch:
#   megatron-lm  (default) Megatron-LM's pretrain_gpt.py through
#                `python -m megatron_envpipe.megatron.pretrain_gpt` (its flags plus --envpipe-*),
#                NCCL, one process per GPU; needs MEGATRON_LM=<Megatron-LM checkout>
#   tiny-cpu     the tiny GPT (`python -m megatron_envpipe.apps.train_tiny_gpt --device cpu`),
#                gloo, one process per pipeline stage, no GPU (laptops, CI, tests/slurm)
#   tiny-gpu     the tiny GPT on GPUs (--device cuda), NCCL: a quick smoke test
#
# Set ENVPIPE_DRY_RUN=1 to print the torchrun command instead of running it, and
# ENVPIPE_DISABLE=1 to run stock Megatron (EnvPipe never installed), the
# reference EnvPipe's losses must equal bit for bit.

# ----------------------------------------------------------------------------- knobs
ENVPIPE_EXAMPLE=${ENVPIPE_EXAMPLE:-megatron-lm}
PYTHON=${PYTHON:-python3}          # the Python that has torch, megatron-core and megatron-envpipe
ENVPIPE_DRY_RUN=${ENVPIPE_DRY_RUN:-0}
# 1: stock Megatron, no EnvPipe: the tiny GPT runs with --no-envpipe, megatron-lm runs
# $MEGATRON_LM/pretrain_gpt.py itself; no --envpipe-* flags (the ENVPIPE_<NAME> knobs are ignored).
ENVPIPE_DISABLE=${ENVPIPE_DISABLE:-0}

# EnvPipe: ENVPIPE_<NAME> is the flag --envpipe-<name>. An empty value leaves the
# flag out, so the package's default applies (noted after each).
ENVPIPE_TYPE=${ENVPIPE_TYPE:-envelope}                   # baseline | uniform | envelope | optimal
ENVPIPE_SCHEDULING=${ENVPIPE_SCHEDULING:-ours}           # 1f1b (Megatron's order) | ours (extended warm-up) | interleaved (needs VPP)
ENVPIPE_RECONFIG=${ENVPIPE_RECONFIG:-balanced}           # default (none) | greedy | balanced
ENVPIPE_GPU=${ENVPIPE_GPU:-auto}                         # auto | none | nvml | simulated:<profile> | a40, h100, ... (envpipe gpus)
ENVPIPE_PROFILE=${ENVPIPE_PROFILE:-}                     # Perseus CSV of this model and layout; empty: start-up profiler
ENVPIPE_PROFILE_CACHE=${ENVPIPE_PROFILE_CACHE:-}         # profile cache dir, or off; empty: ~/.cache/megatron-envpipe/profiles
ENVPIPE_PROFILE_STEP=${ENVPIPE_PROFILE_STEP:-}           # start-up profiler: MHz between clocks; empty: GPU table
ENVPIPE_PROFILE_ITERATIONS=${ENVPIPE_PROFILE_ITERATIONS:-2}   # start-up profiler: iterations per clock
ENVPIPE_MEASURE_ITERATIONS=${ENVPIPE_MEASURE_ITERATIONS:-1}   # iterations timed before planning without clock control
ENVPIPE_ON_NO_PERMISSION=${ENVPIPE_ON_NO_PERMISSION:-fail}    # fail | monitor (train, only measure energy)
ENVPIPE_MAX_INFLIGHT=${ENVPIPE_MAX_INFLIGHT:-}           # activation budget for ours: auto, none, N, b0,b1,...; empty: auto
ENVPIPE_EXTRA_WARMUP=${ENVPIPE_EXTRA_WARMUP:-}           # e.g. 4,3,1,0; empty: EnvPipe's
ENVPIPE_P2P_POWER=${ENVPIPE_P2P_POWER:-}                 # W of a GPU blocked in P2P; empty: GPU table
ENVPIPE_RECONFIG_STEP=${ENVPIPE_RECONFIG_STEP:-}         # MHz per reconfiguration step; empty: GPU table
ENVPIPE_MAX_SLOWDOWN=${ENVPIPE_MAX_SLOWDOWN:-}           # optimal: allowed slowdown, e.g. 0.05; empty: 0
ENVPIPE_DEADLINE_FROM=${ENVPIPE_DEADLINE_FROM:-}         # optimal: plan to another schedule's time, e.g. 1f1b; empty: own
ENVPIPE_TARGET_TIME=${ENVPIPE_TARGET_TIME:-}             # optimal: s per iteration something else sets; empty: none
ENVPIPE_SWITCH_COST_J=${ENVPIPE_SWITCH_COST_J:-}         # J per clock change the plan may give up to avoid one; empty: off
ENVPIPE_MAX_CLOCK_CHANGES=${ENVPIPE_MAX_CLOCK_CHANGES:-} # clock changes per rank per iteration; empty: no budget
ENVPIPE_FINISH_LIMIT=${ENVPIPE_FINISH_LIMIT:-10}         # stop reconfiguring after N iterations without progress
ENVPIPE_TIMING_MARGIN=${ENVPIPE_TIMING_MARGIN:-}         # slack kept behind slowed units (fraction); empty: 0.01
ENVPIPE_RECONFIG_WINDOW=${ENVPIPE_RECONFIG_WINDOW:-}     # iterations whose median decides a correction; empty: 3
ENVPIPE_THRESHOLD_SCALE=${ENVPIPE_THRESHOLD_SCALE:-4.0}  # critical-path wait threshold
ENVPIPE_PREFETCH=${ENVPIPE_PREFETCH:-2}                  # receives posted ahead per channel
ENVPIPE_COMM_TIMEOUT=${ENVPIPE_COMM_TIMEOUT:-300}        # s before a stuck P2P transfer raises
ENVPIPE_SIM_TIME_SCALE=${ENVPIPE_SIM_TIME_SCALE:-0.02}   # simulated GPU: wall s per simulated s
ENVPIPE_SIM_JITTER=${ENVPIPE_SIM_JITTER:-}               # simulated GPU: unit-time noise, e.g. 0.03; empty: none
ENVPIPE_SIM_UNIT_SCALE=${ENVPIPE_SIM_UNIT_SCALE:-}       # simulated GPU: unit times x this, e.g. 0.25 (a faster GPU); empty: 1
ENVPIPE_SIM_TIME=${ENVPIPE_SIM_TIME:-}                   # simulated GPU: virtual | wall; empty: virtual
ENVPIPE_SIM_DYNAMICS=${ENVPIPE_SIM_DYNAMICS:-}           # simulated GPU: exact | realistic | FILE; empty: exact
ENVPIPE_SIM_CLOCK_LATENCY_MS=${ENVPIPE_SIM_CLOCK_LATENCY_MS:-}    # simulated GPU: clock latency, ms; empty: the preset's
ENVPIPE_SIM_COUNTER_PERIOD_MS=${ENVPIPE_SIM_COUNTER_PERIOD_MS:-}  # simulated GPU: energy-counter period, ms; empty: the preset's
ENVPIPE_SIM_THERMAL_DRIFT=${ENVPIPE_SIM_THERMAL_DRIFT:-}          # simulated GPU: heat drift, e.g. 0.03; empty: the preset's
ENVPIPE_CLOCK_LEAD=${ENVPIPE_CLOCK_LEAD:-on}             # request clock raises ahead of the boundary by the latency: on | off
ENVPIPE_SIM_MEMORY=${ENVPIPE_SIM_MEMORY:-}               # memory model for max-inflight auto off CUDA: GIB_FREE,MIB_PER_MICROBATCH
ENVPIPE_LOG_INTERVAL=${ENVPIPE_LOG_INTERVAL:-}           # energy line every N iterations; empty: Megatron's --log-interval (LOG_INTERVAL)
ENVPIPE_BASELINE_ITERATIONS=${ENVPIPE_BASELINE_ITERATIONS:-}   # 1F1B iterations at f_max measured as the baseline; empty: 2
ENVPIPE_ENERGY_CSV=${ENVPIPE_ENERGY_CSV:-}               # per-GPU energy rows appended to this CSV; empty: none
ENVPIPE_VERBOSE=${ENVPIPE_VERBOSE:-0}                    # 1: print each stage's instruction program
ENVPIPE_FOLLOW_STRAGGLERS=${ENVPIPE_FOLLOW_STRAGGLERS:-}       # 0: never follow a slower data-parallel pipeline; empty: follow
ENVPIPE_STRAGGLER_THRESHOLD=${ENVPIPE_STRAGGLER_THRESHOLD:-}   # follow when the slowest is this fraction slower; empty: 0.02
ENVPIPE_STRAGGLER_WINDOW=${ENVPIPE_STRAGGLER_WINDOW:-}         # agree on the slowest pace every N iterations; empty: 3
ENVPIPE_SIM_STRAGGLER=${ENVPIPE_SIM_STRAGGLER:-}               # simulated GPU: REPLICA:FACTOR[@ITER], e.g. 1:1.15; empty: none
ENVPIPE_PER_ITERATION_PLANS=${ENVPIPE_PER_ITERATION_PLANS:-}   # variable lengths: 0: no per-iteration plans; empty: on with optimal
# After torchrun, on every node: `envpipe reset-clocks` repairs GPUs whose clocks
# the run left locked. force: also GPUs whose locking process still runs (a
# straggler; right on exclusive nodes); yes: only those of dead processes; no: skip.
# Runs record locked clocks in $ENVPIPE_STATE_DIR (default /var/lib/megatron-envpipe/locked-clocks).
ENVPIPE_RESET_CLOCKS=${ENVPIPE_RESET_CLOCKS:-force}
export PYTHON ENVPIPE_RESET_CLOCKS

# ----------------------------------------------------------------------------- helpers

envpipe_log() { printf 'envpipe-launch: %s\n' "$*"; }
envpipe_die() { printf 'envpipe-launch: error: %s\n' "$*" >&2; exit 2; }

# True when ENVPIPE_DISABLE asks for stock Megatron.
envpipe_disabled() {
    case "$ENVPIPE_DISABLE" in
        1 | yes | true) return 0 ;;
        0 | no | false | "") return 1 ;;
        *) envpipe_die "ENVPIPE_DISABLE=$ENVPIPE_DISABLE: use 1 (stock Megatron, no EnvPipe) or 0" ;;
    esac
}

# What runs, for the launch log.
envpipe_describe() {
    if envpipe_disabled; then
        printf 'envpipe off (stock Megatron)'
    else
        printf 'envpipe %s/%s/%s, gpu %s' "$ENVPIPE_TYPE" "$ENVPIPE_SCHEDULING" "$ENVPIPE_RECONFIG" "$ENVPIPE_GPU"
    fi
}

# Append "--flag value" to ENVPIPE_ARGS when value is not empty.
_envpipe_opt() {
    if [ -n "$2" ]; then
        ENVPIPE_ARGS+=("$1" "$2")
    fi
}

# ----------------------------------------------------------------------------- arrays

# Compose GPT_MODEL_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS, DATA_ARGS,
# EVAL_AND_LOGGING_ARGS, ENVPIPE_ARGS and ENTRY_ARGS (the module torchrun runs)
# for ENVPIPE_EXAMPLE. Needs NNODES and GPUS_PER_NODE (processes per node).
# shellcheck disable=SC2034  # the arrays are for the launcher that sourced this file
envpipe_compose_args() {
    : "${NNODES:?}" "${GPUS_PER_NODE:?}"
    local world=$((NNODES * GPUS_PER_NODE)) model_parallel

    case "$ENVPIPE_EXAMPLE" in
    megatron-lm)
        : "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (the tag matching your megatron-core)}"
        [ -f "$MEGATRON_LM/pretrain_gpt.py" ] || envpipe_die "MEGATRON_LM=$MEGATRON_LM has no pretrain_gpt.py"
        export MEGATRON_LM PYTHONPATH="$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}"
        # Megatron's rule: one CUDA connection only for TP (or CP) > 1, pre-Blackwell, no FSDP.
        TP=${TP:-1}
        PP=${PP:-4}
        model_parallel=$((TP * PP))
        if [ "$TP" -gt 1 ]; then
            export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
        fi
        NUM_LAYERS=${NUM_LAYERS:-24}
        HIDDEN_SIZE=${HIDDEN_SIZE:-2048}
        NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-16}
        SEQ_LENGTH=${SEQ_LENGTH:-2048}
        MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
        GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-64}
        TRAIN_ITERS=${TRAIN_ITERS:-500}
        LR=${LR:-6.0e-5}
        DATA_PATH=${DATA_PATH:-}          # Megatron indexed dataset prefix; empty: --mock-data
        VOCAB_FILE=${VOCAB_FILE:-}        # GPT-2 BPE vocab.json, with DATA_PATH
        MERGE_FILE=${MERGE_FILE:-}        # GPT-2 BPE merges.txt, with DATA_PATH
        CHECKPOINT_PATH=${CHECKPOINT_PATH:-}          # --save/--load; empty: no checkpoints
        TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-}
        LOG_INTERVAL=${LOG_INTERVAL:-10}
        EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
        EVAL_ITERS=${EVAL_ITERS:-10}

        ENTRY_ARGS=(-m megatron_envpipe.megatron.pretrain_gpt)
        GPT_MODEL_ARGS=(
            --num-layers "$NUM_LAYERS"
            --hidden-size "$HIDDEN_SIZE"
            --num-attention-heads "$NUM_ATTENTION_HEADS"
            --seq-length "$SEQ_LENGTH"
            --max-position-embeddings "$SEQ_LENGTH"
        )
        TRAINING_ARGS=(
            --micro-batch-size "$MICRO_BATCH_SIZE"
            --global-batch-size "$GLOBAL_BATCH_SIZE"
            --train-iters "$TRAIN_ITERS"
            --weight-decay 0.1
            --adam-beta1 0.9
            --adam-beta2 0.95
            --init-method-std 0.006
            --clip-grad 1.0
            --bf16
            --lr "$LR"
            --lr-decay-style cosine
            --min-lr "$(awk -v lr="$LR" 'BEGIN { print lr / 10 }')"
            --lr-warmup-fraction .001
            --lr-decay-iters "$TRAIN_ITERS"
        )
        MODEL_PARALLEL_ARGS=(
            --tensor-model-parallel-size "$TP"
            --pipeline-model-parallel-size "$PP"
        )
        if [ -n "$DATA_PATH" ]; then
            DATA_ARGS=(
                --data-path "$DATA_PATH"
                --tokenizer-type GPT2BPETokenizer
                --vocab-file "${VOCAB_FILE:?set VOCAB_FILE with DATA_PATH}"
                --merge-file "${MERGE_FILE:?set MERGE_FILE with DATA_PATH}"
                --split "949,50,1"
            )
        else
            DATA_ARGS=(
                --mock-data
                --tokenizer-type NullTokenizer
                --vocab-size "${VOCAB_SIZE:-32000}"
            )
        fi
        EVAL_AND_LOGGING_ARGS=(
            --log-interval "$LOG_INTERVAL"
            --eval-interval "$EVAL_INTERVAL"
            --eval-iters "$EVAL_ITERS"
        )
        if [ -n "$CHECKPOINT_PATH" ]; then
            EVAL_AND_LOGGING_ARGS+=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
                                    --save-interval "${SAVE_INTERVAL:-1000}")
        fi
        if [ -n "$TENSORBOARD_LOGS_PATH" ]; then
            EVAL_AND_LOGGING_ARGS+=(--tensorboard-dir "$TENSORBOARD_LOGS_PATH")
        fi
        ;;
    tiny-cpu | tiny-gpu)
        local device=cpu
        if [ "$ENVPIPE_EXAMPLE" = tiny-gpu ]; then
            device=cuda
        else
            # gloo ranks share the node's cores: one thread each.
            export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
        fi
        # One rank per pipeline stage (TP = DP = 1).
        PP=${PP:-$world}
        model_parallel=$PP
        NUM_LAYERS=${NUM_LAYERS:-8}
        HIDDEN_SIZE=${HIDDEN_SIZE:-64}
        NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
        SEQ_LENGTH=${SEQ_LENGTH:-64}
        MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-2}
        GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-16}
        TRAIN_ITERS=${TRAIN_ITERS:-10}
        LR=${LR:-3e-3}
        SEED=${SEED:-1234}
        VOCAB_SIZE=${VOCAB_SIZE:-512}
        TOKENIZER_CACHE=${TOKENIZER_CACHE:-}   # empty: $MEGATRON_ENVPIPE_CACHE or ~/.cache/megatron-envpipe
        LOSSES_OUT=${LOSSES_OUT:-}             # per-iteration losses as JSON (exact floats)
        LOG_INTERVAL=${LOG_INTERVAL:-1}

        ENTRY_ARGS=(-m megatron_envpipe.apps.train_tiny_gpt)
        GPT_MODEL_ARGS=(
            --num-layers "$NUM_LAYERS"
            --hidden-size "$HIDDEN_SIZE"
            --num-attention-heads "$NUM_ATTENTION_HEADS"
            --seq-length "$SEQ_LENGTH"
        )
        TRAINING_ARGS=(
            --micro-batch-size "$MICRO_BATCH_SIZE"
            --global-batch-size "$GLOBAL_BATCH_SIZE"
            --train-iters "$TRAIN_ITERS"
            --lr "$LR"
            --seed "$SEED"
            --device "$device"
        )
        MODEL_PARALLEL_ARGS=(
            --pipeline-model-parallel-size "$PP"
        )
        DATA_ARGS=(
            --vocab-size "$VOCAB_SIZE"
        )
        if [ -n "$TOKENIZER_CACHE" ]; then
            DATA_ARGS+=(--cache-dir "$TOKENIZER_CACHE")
        fi
        EVAL_AND_LOGGING_ARGS=(
            --log-interval "$LOG_INTERVAL"
        )
        if [ -n "$LOSSES_OUT" ]; then
            EVAL_AND_LOGGING_ARGS+=(--losses-out "$LOSSES_OUT")
        fi
        ;;
    *)
        envpipe_die "ENVPIPE_EXAMPLE=$ENVPIPE_EXAMPLE: choose megatron-lm, tiny-cpu or tiny-gpu"
        ;;
    esac

    ENVPIPE_ARGS=(
        --envpipe-type "$ENVPIPE_TYPE"
        --envpipe-scheduling "$ENVPIPE_SCHEDULING"
        --envpipe-reconfig "$ENVPIPE_RECONFIG"
        --envpipe-gpu "$ENVPIPE_GPU"
        --envpipe-on-no-permission "$ENVPIPE_ON_NO_PERMISSION"
        --envpipe-profile-iterations "$ENVPIPE_PROFILE_ITERATIONS"
        --envpipe-measure-iterations "$ENVPIPE_MEASURE_ITERATIONS"
        --envpipe-finish-limit "$ENVPIPE_FINISH_LIMIT"
        --envpipe-threshold-scale "$ENVPIPE_THRESHOLD_SCALE"
        --envpipe-prefetch "$ENVPIPE_PREFETCH"
        --envpipe-comm-timeout "$ENVPIPE_COMM_TIMEOUT"
        --envpipe-sim-time-scale "$ENVPIPE_SIM_TIME_SCALE"
    )
    _envpipe_opt --envpipe-log-interval "$ENVPIPE_LOG_INTERVAL"
    _envpipe_opt --envpipe-baseline-iterations "$ENVPIPE_BASELINE_ITERATIONS"
    _envpipe_opt --envpipe-energy-csv "$ENVPIPE_ENERGY_CSV"
    _envpipe_opt --envpipe-profile "$ENVPIPE_PROFILE"
    _envpipe_opt --envpipe-profile-cache "$ENVPIPE_PROFILE_CACHE"
    _envpipe_opt --envpipe-profile-step "$ENVPIPE_PROFILE_STEP"
    _envpipe_opt --envpipe-max-inflight "$ENVPIPE_MAX_INFLIGHT"
    _envpipe_opt --envpipe-sim-memory "$ENVPIPE_SIM_MEMORY"
    _envpipe_opt --envpipe-extra-warmup "$ENVPIPE_EXTRA_WARMUP"
    _envpipe_opt --envpipe-p2p-power "$ENVPIPE_P2P_POWER"
    _envpipe_opt --envpipe-reconfig-step "$ENVPIPE_RECONFIG_STEP"
    _envpipe_opt --envpipe-max-slowdown "$ENVPIPE_MAX_SLOWDOWN"
    _envpipe_opt --envpipe-deadline-from "$ENVPIPE_DEADLINE_FROM"
    _envpipe_opt --envpipe-target-time "$ENVPIPE_TARGET_TIME"
    _envpipe_opt --envpipe-switch-cost-j "$ENVPIPE_SWITCH_COST_J"
    _envpipe_opt --envpipe-max-clock-changes "$ENVPIPE_MAX_CLOCK_CHANGES"
    _envpipe_opt --envpipe-timing-margin "$ENVPIPE_TIMING_MARGIN"
    _envpipe_opt --envpipe-reconfig-window "$ENVPIPE_RECONFIG_WINDOW"
    _envpipe_opt --envpipe-sim-jitter "$ENVPIPE_SIM_JITTER"
    _envpipe_opt --envpipe-sim-unit-scale "$ENVPIPE_SIM_UNIT_SCALE"
    _envpipe_opt --envpipe-sim-time "$ENVPIPE_SIM_TIME"
    _envpipe_opt --envpipe-sim-dynamics "$ENVPIPE_SIM_DYNAMICS"
    _envpipe_opt --envpipe-sim-clock-latency-ms "$ENVPIPE_SIM_CLOCK_LATENCY_MS"
    _envpipe_opt --envpipe-sim-counter-period-ms "$ENVPIPE_SIM_COUNTER_PERIOD_MS"
    _envpipe_opt --envpipe-sim-thermal-drift "$ENVPIPE_SIM_THERMAL_DRIFT"
    _envpipe_opt --envpipe-clock-lead "$ENVPIPE_CLOCK_LEAD"
    case "$ENVPIPE_VERBOSE" in
        1 | yes | true) ENVPIPE_ARGS+=(--envpipe-verbose) ;;
    esac
    case "$ENVPIPE_FOLLOW_STRAGGLERS" in
        1 | yes | true) ENVPIPE_ARGS+=(--envpipe-follow-stragglers) ;;
        0 | no | false) ENVPIPE_ARGS+=(--no-envpipe-follow-stragglers) ;;
    esac
    _envpipe_opt --envpipe-straggler-threshold "$ENVPIPE_STRAGGLER_THRESHOLD"
    _envpipe_opt --envpipe-straggler-window "$ENVPIPE_STRAGGLER_WINDOW"
    _envpipe_opt --envpipe-sim-straggler "$ENVPIPE_SIM_STRAGGLER"
    case "$ENVPIPE_PER_ITERATION_PLANS" in
        1 | yes | true) ENVPIPE_ARGS+=(--envpipe-per-iteration-plans) ;;
        0 | no | false) ENVPIPE_ARGS+=(--no-envpipe-per-iteration-plans) ;;
    esac
    if envpipe_disabled; then
        # Stock Megatron: EnvPipe is never installed, so nothing of it can touch the run.
        if [ "$ENVPIPE_EXAMPLE" = megatron-lm ]; then
            ENTRY_ARGS=("$MEGATRON_LM/pretrain_gpt.py")
            ENVPIPE_ARGS=()
        else
            ENVPIPE_ARGS=(--no-envpipe)
        fi
    fi

    if [ "$model_parallel" -gt "$world" ] || [ $((world % model_parallel)) -ne 0 ]; then
        envpipe_die "TP x PP = $model_parallel does not divide the $world processes ($NNODES node(s) x $GPUS_PER_NODE)"
    fi
}

# ----------------------------------------------------------------------------- clocks and the node runner

# `envpipe reset-clocks` on this node (ENVPIPE_RESET_CLOCKS: force | yes | no).
# Never fails: a repair that cannot run says so and how to do it by hand.
envpipe_reset_clocks() {
    local where="$1" flag=
    [ "$ENVPIPE_DRY_RUN" != 1 ] || return 0
    case "$ENVPIPE_RESET_CLOCKS" in
        no | off | 0) return 0 ;;
        yes | on | 1) flag= ;;
        *) flag=--force ;;
    esac
    envpipe_log "$where: envpipe reset-clocks ${flag}"
    # shellcheck disable=SC2086  # $flag is one word or none
    # Its exit status, not sed's, whatever the caller's pipefail setting.
    local status=0
    { timeout 120 "$PYTHON" -m megatron_envpipe.apps.cli reset-clocks $flag 2>&1 | sed "s|^|envpipe-launch: $where: |"
      status=${PIPESTATUS[0]}; } || true
    if [ "$status" != 0 ]; then
        envpipe_log "$where: reset-clocks failed (exit $status): run \`envpipe reset-clocks --force\` on $(hostname) by hand (as root)"
    fi
    return 0
}

# Run one node's torchrun ("$@"), then reset this node's GPU clocks, whatever
# the outcome: success, failure, or termination. scancel and the time limit
# SIGTERM every process of a SLURM step (torchrun stops its workers, whose own
# handlers reset the clocks they locked; this runner then repairs what a
# SIGKILLed worker left); outside SLURM, SIGTERM/SIGINT/SIGHUP to this shell
# are passed on to torchrun. Returns torchrun's exit status.
envpipe_node_run() {
    local where status=0
    where="node ${SLURMD_NODENAME:-$(hostname -s)}${SLURM_NODEID:+ (rank $SLURM_NODEID)}"
    if [ "$ENVPIPE_DRY_RUN" = 1 ]; then
        printf '%q ' "$@"
        printf '\n'
        return 0
    fi
    envpipe_log "$where: $*"
    local own_group=0
    if [ -z "${SLURM_STEP_ID:-}" ] && [[ $- != *m* ]]; then
        # Outside SLURM: torchrun in its own process group, so that a Ctrl-C
        # reaches it once, through this shell, not twice.
        set -m
        own_group=1
    fi
    "$@" &
    _ENVPIPE_CHILD=$!
    _ENVPIPE_SIGNALLED=0
    if [ "$own_group" = 1 ]; then
        set +m
    fi
    trap _envpipe_on_signal TERM INT HUP
    while :; do
        if wait "$_ENVPIPE_CHILD"; then status=0; else status=$?; fi
        # A trapped signal ends `wait` early (status > 128): wait again for torchrun.
        kill -0 "$_ENVPIPE_CHILD" 2>/dev/null || break
    done
    trap - TERM INT HUP
    envpipe_log "$where: torchrun exited with status $status$([ "$_ENVPIPE_SIGNALLED" = 0 ] || echo ' (terminated)')"
    envpipe_reset_clocks "$where"
    return "$status"
}

_envpipe_on_signal() {
    if [ "$_ENVPIPE_SIGNALLED" = 0 ]; then
        _ENVPIPE_SIGNALLED=1
        # Under srun, SLURM has signalled torchrun and its workers itself; a
        # second SIGTERM would interrupt torchrun's own shutdown.
        if [ -z "${SLURM_STEP_ID:-}" ]; then
            kill -TERM "$_ENVPIPE_CHILD" 2>/dev/null || true
        fi
    fi
}
