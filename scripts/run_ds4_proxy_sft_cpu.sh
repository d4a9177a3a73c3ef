#!/usr/bin/env bash
# Tiny DeepSeek-V4 SFT on CPU with verl's own SFT trainer and verl-ds4's Megatron engine.
#
#   data (arithmetic chats; TASK=digits: the CPU RL task's demonstrations) -> DS4 chat encoding (DS4ChatSFTDataset) -> THD packing, contiguous CP
#   -> the full tiny DS4 (Megatron GPTModel: mHC, DS4 attention, DS4 MoE with a hash layer) -> loss
#   -> optimizer step -> checkpoint
#
# MODEL picks the model (the assets step writes its folder under $WORK_DIR/assets/model):
#   ds4        (default) the full tiny DeepSeek-V4: a real DS4 checkpoint folder (DeepseekV4Config,
#              safetensors of a seeded init, tokenizer) that transformers' DeepseekV4ForCausalLM loads;
#              the CPU engine starts from those weights.
#   ds4_proxy  the attention-only DS4 proxy (DS4 attention, dense MLP, no mHC / MoE), seeded init.
#   tiny_dense a Llama-shaped dense model (the stepping stone).
#   ds41       the tiny DeepSeek-V4.1 (CSA2 ratio 0/1/2 layers with shared KV / index sources, Engram
#              with the folder's tokenizer, single-pass mHC, V4's MoE; no DSpark drafter): a V4.1 folder
#              in our names (config.json, model.safetensors of a seeded init, tokenizer.json).
# The file name keeps "proxy" for the README command; WORK_DIR defaults to runs/${MODEL}_sft_cpu.
#
# Runs `torchrun --nproc_per_node=2 -m verl.trainer.sft_trainer engine=megatron optim=megatron ...`
# on the CPU: VERL_PLATFORM=cpu selects verl-ds4's CPU platform (gloo), verl imports the CPU
# platform and the CPU Megatron engines through VERL_USE_EXTERNAL_MODULES.
#
# Multi-node (scripts/slurm_sft.sbatch with DS4_DEVICE=cpu sets these on every node): NNODES nodes of
# NPROC processes each, this node's NODE_RANK, the rendezvous MASTER_ADDR:MASTER_PORT, exactly as the
# GPU launcher's torchrun gets them. With NNODES > 1 each node writes the (deterministic) assets to
# $WORK_DIR/assets/node<NODE_RANK> and its log to $WORK_DIR/logs/<timestamp>-node<NODE_RANK>.log;
# the checkpoints folder is shared.
#
# Usage:  bash scripts/run_ds4_proxy_sft_cpu.sh [--verbose] [extra Hydra overrides...]
#         bash scripts/run_ds4_proxy_sft_cpu.sh --print-ckpt-dir   # the checkpoint folder these knobs give (runs nothing)
#   resume after an interruption: run the same command again (trainer.resume_mode=auto); MAX_RESTARTS=N does it by
#   itself up to N times when the run dies (verl_ds4.recipes.supervise; docs/checkpoints.md, "Automatic restart").
#
# The console is quiet (verl_ds4.cpu.console): start-up facts, a progress line every few steps with
# an ETA, and a summary (loss trend, tokens/s, checkpoint; loss curve in $WORK_DIR/loss.png).
# verl's, Megatron's and torchrun's full output goes to $WORK_DIR/logs/<timestamp>.log (also
# logs/latest.log); VERBOSE=1 or --verbose shows it on the console too. On a failure the last 40
# lines of that log are printed and the script exits non-zero.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# ---------------------------------- user-adjustable ----------------------------------
PYTHON=${PYTHON:-python}
NPROC=${NPROC:-2}                       # processes (CPU "devices") on this node
NNODES=${NNODES:-1}                     # nodes (torchrun --nnodes); world size = NNODES * NPROC
NODE_RANK=${NODE_RANK:-0}               # this node's rank (torchrun --node_rank)
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}   # rendezvous address: node 0's (torchrun --master_addr)
CP=${CP:-2}                             # context-parallel size; data-parallel size = NNODES * NPROC / CP
MODEL=${MODEL:-ds4}                     # ds4 (full tiny DS4) | ds4_proxy (attention-only) | tiny_dense | ds41 (DeepSeek-V4.1)
TASK=${TASK:-arithmetic}                # arithmetic (Q/A chats) | digits (the CPU RL task's demonstrations) | long (arithmetic
                                        # turns packed into rows of up to MAX_SEQ_LEN tokens: one long sequence per row)
MAX_SEQ_LEN=${MAX_SEQ_LEN:-}            # the longest sequence (data.max_length; empty: 256). Refused above the model's
                                        # max_position_embeddings (tiny DS4: 4096), and rows longer than it are counted and refused
MAX_POSITIONS=${MAX_POSITIONS:-}        # the tiny model folder's max_position_embeddings (empty: the model's own), e.g. 16384
WORK_DIR=${WORK_DIR:-runs/${MODEL}_sft_cpu}
N_TRAIN=${N_TRAIN:-400}                 # conversations written to the training parquet
STEPS=${STEPS:-80}                      # optimizer steps
BATCH=${BATCH:-16}                      # global batch size (conversations per step)
MICRO_BATCH=${MICRO_BATCH:-8}           # conversations per micro-batch per data-parallel rank
LR=${LR:-3e-3}
SAVE_FREQ=${SAVE_FREQ:-40}              # checkpoint every N steps (and at the last step)
ASYNC_SAVE=${ASYNC_SAVE:-0}             # 1: Megatron's async saves (training goes on while the shards are written; the
                                        # manifest and the tracker follow once every rank's write is finalised)
SEED=${SEED:-42}
DTYPE=${DTYPE:-float32}                 # float32 (CPU engine config) | bfloat16 (verl's default)
RESUME_MODE=${RESUME_MODE:-auto}        # auto | disable | resume_path
MAX_RESTARTS=${MAX_RESTARTS:-0}         # restarts from the newest intact checkpoint after the run dies (0 here: the demo
                                        # stops at the first failure; the Slurm and Ray launchers default to 3)
MASTER_PORT=${MASTER_PORT:-29561}
VERBOSE=${VERBOSE:-0}                   # 1: verl's, Megatron's and torchrun's full output on the console
PRINT_EVERY=${PRINT_EVERY:-0}           # a progress line every N steps (0: about 20 lines per run)
# --------------------------------------------------------------------------------------

OVERRIDES=()
for arg in "$@"; do
    case "$arg" in
        --verbose) VERBOSE=1 ;;
        --print-ckpt-dir) echo "$WORK_DIR/checkpoints"; exit 0 ;;
        *) OVERRIDES+=("$arg") ;;
    esac
done

for knob in NPROC NNODES CP; do
    if ! [[ ${!knob} =~ ^[1-9][0-9]*$ ]]; then
        echo "$knob=${!knob}: expected a positive integer" >&2; exit 2
    fi
done
if [ "$ASYNC_SAVE" != 0 ] && [ "$ASYNC_SAVE" != 1 ]; then
    echo "ASYNC_SAVE=$ASYNC_SAVE: expected 0 (synchronous saves) or 1 (Megatron's async saves)" >&2; exit 2
fi
for knob in MAX_SEQ_LEN MAX_POSITIONS; do
    if [ -n "${!knob}" ] && ! [[ ${!knob} =~ ^[1-9][0-9]*$ ]]; then
        echo "$knob=${!knob}: expected a positive integer (tokens), e.g. $knob=16384" >&2; exit 2
    fi
done
if [ "$TASK" = long ] && [ -z "$MAX_SEQ_LEN" ]; then
    echo "TASK=long: needs MAX_SEQ_LEN (the tokens of each packed row), e.g. MAX_SEQ_LEN=16384 MAX_POSITIONS=16384 TASK=long" >&2; exit 2
fi
for arg in ${OVERRIDES[@]+"${OVERRIDES[@]}"}; do
    case "${arg#"${arg%%[!+]*}"}" in   # the key without leading + signs
        data.max_length=*)
            if [ -n "$MAX_SEQ_LEN" ] && [ "${arg#*=}" != "$MAX_SEQ_LEN" ]; then
                echo "$arg with MAX_SEQ_LEN=$MAX_SEQ_LEN: two different lengths; give one (MAX_SEQ_LEN sets data.max_length)" >&2; exit 2
            fi ;;
    esac
done
SEQ_LEN=${MAX_SEQ_LEN:-256}
if ! [[ $NODE_RANK =~ ^[0-9]+$ ]] || [ "$NODE_RANK" -ge "$NNODES" ]; then
    echo "NODE_RANK=$NODE_RANK: expected 0 to $((NNODES - 1)) (NNODES=$NNODES)" >&2; exit 2
fi
WORLD=$((NNODES * NPROC))
if [ $((WORLD % CP)) != 0 ]; then
    echo "CP=$CP does not divide the world size $WORLD (NNODES=$NNODES x NPROC=$NPROC): pick CP among its divisors" >&2; exit 2
fi

# Automatic restart (verl_ds4.recipes.supervise): with MAX_RESTARTS > 0 the launcher runs itself again under the
# supervisor, which refuses a bad MAX_RESTARTS and a checkpoint folder that cannot take a checkpoint first, then
# restarts a run that dies from its newest intact checkpoint (RESUME_MODE=auto); with 0 only those checks run.
# DS4_SUPERVISED: already supervised (by it, or by the Slurm batch script around every node); DS4_CKPT_CHECKED:
# the supervisor checked the folder.
if [ -z "${DS4_SUPERVISED:-}" ] && [ "$MAX_RESTARTS" != 0 ]; then
    exec "$PYTHON" -W ignore -m verl_ds4.recipes.supervise --max-restarts "$MAX_RESTARTS" --resume-mode "$RESUME_MODE" \
        --ckpt-dir "$WORK_DIR/checkpoints" -- bash "scripts/$(basename "${BASH_SOURCE[0]}")" "$@"
elif [ -z "${DS4_CKPT_CHECKED:-}" ] && ! "$PYTHON" -W ignore -m verl_ds4.recipes.supervise --check-only \
        --max-restarts "$MAX_RESTARTS" --ckpt-dir "$WORK_DIR/checkpoints"; then
    exit 2
fi
# Multi-node: the checkpoint folder must be one folder that every node sees (a node-local disk is refused here,
# on every node, with the reason; verl_ds4.recipes.shared_folder, docs/checkpoints.md).
if [ "$NNODES" -gt 1 ] && ! MASTER_ADDR="$MASTER_ADDR" MASTER_PORT="$MASTER_PORT" "$PYTHON" -W ignore \
        -m verl_ds4.recipes.shared_folder --dir "$WORK_DIR/checkpoints" \
        --nodes "$NNODES" --node-rank "$NODE_RANK"; then
    exit 2
fi

ASSETS="$WORK_DIR/assets"
NODE_SUFFIX=""
if [ "$NNODES" -gt 1 ]; then
    ASSETS="$WORK_DIR/assets/node$NODE_RANK"   # every node writes the same files; none reads another's half-written
    NODE_SUFFIX="-node$NODE_RANK"
fi
case "$MODEL" in
    ds4|ds4_proxy) MODEL_LIB=verl_ds4.cpu.ds4_builder ;;   # registers the deepseek_v4 CPU builder
    tiny_dense) MODEL_LIB=verl_ds4.cpu.tiny_dense ;;          # registers the llama CPU builder
    ds41) MODEL_LIB=verl_ds4.cpu.ds41_builder ;;              # registers the deepseek_v41 CPU builder
    *) echo "MODEL=$MODEL: expected one of the known models ds4 (the full tiny DS4, default), ds4_proxy (attention-only), tiny_dense or ds41 (DeepSeek-V4.1), e.g. MODEL=ds4" >&2; exit 2 ;;
esac
case "$DTYPE" in
    # verl's McoreEngineConfig admits only half precision; the CPU engine's config subclass adds fp32.
    float32|fp32) DTYPE_ARGS=(engine._target_=verl_ds4.cpu.engine.CPUMcoreEngineConfig engine.dtype=float32) ;;
    bfloat16|float16) DTYPE_ARGS=(engine.dtype="$DTYPE") ;;
    *) echo "DTYPE=$DTYPE: expected float32, bfloat16 or float16" >&2; exit 2 ;;
esac

export VERL_PLATFORM=cpu
# VERL_DS4_TEST_MODULES: test-only modules the trainer imports too (the chaos runs' holds, verl_ds4/testing).
export VERL_USE_EXTERNAL_MODULES=verl_ds4.cpu.platform,verl_ds4.cpu.engine${VERL_DS4_TEST_MODULES:+,$VERL_DS4_TEST_MODULES}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

DATA=(
    data.train_files="$ASSETS/data/train.parquet"
    data.val_files=null
    data.train_batch_size="$BATCH"
    data.micro_batch_size_per_gpu="$MICRO_BATCH"
    data.use_dynamic_bsz=False
    data.max_length="$SEQ_LEN"
    data.num_workers=0
    data.custom_cls.path=pkg://verl_ds4.models.ds4.sft_dataset
    data.custom_cls.name=DS4ChatSFTDataset
)
MODEL_ARGS=(
    model.path="$ASSETS/model"
    model.external_lib="$MODEL_LIB"
    model.use_remove_padding=True
)
ENGINE=(
    "${DTYPE_ARGS[@]}"
    engine.tensor_model_parallel_size=1
    engine.pipeline_model_parallel_size=1
    engine.context_parallel_size="$CP"
    engine.sequence_parallel=False
    engine.use_distributed_optimizer=True
    engine.use_dist_checkpointing=True
    engine.seed="$SEED"
)
OPTIM=(
    optim.lr="$LR"
    optim.clip_grad=1.0
    optim.weight_decay=0.01
)
TRAINER=(
    trainer.device=cpu
    'trainer.logger=[console]'
    trainer.project_name=verl-ds4-cpu
    trainer.experiment_name="${MODEL}_cp${CP}"
    trainer.default_local_dir="$WORK_DIR/checkpoints"
    trainer.total_training_steps="$STEPS"
    trainer.total_epochs=100
    trainer.save_freq="$SAVE_FREQ"
    trainer.resume_mode="$RESUME_MODE"
    trainer.seed="$SEED"
)
SAVE_KIND=sync
if [ "$ASYNC_SAVE" = 1 ]; then TRAINER+=(+checkpoint.async_save=True); SAVE_KIND=async; fi

CONSOLE=(
    --work-dir "$WORK_DIR" --steps "$STEPS" --every "$PRINT_EVERY"
    --fact "job=SFT, verl.trainer.sft_trainer on $WORLD CPU processes (torchrun, engine=megatron, $DTYPE)"
    --fact "model=$MODEL ($ASSETS/model)"
    --fact "parallel=CP $CP x DP $(( WORLD / CP )), TP 1, PP 1"
    --fact "data=$ASSETS/data/train.parquet ($N_TRAIN $TASK conversations, <= $SEQ_LEN tokens each), batch $BATCH, $STEPS steps, lr $LR"
    --fact "checkpoints=$WORK_DIR/checkpoints (every $SAVE_FREQ steps, $SAVE_KIND saves, resume_mode=$RESUME_MODE)"
    --fact "restarts=MAX_RESTARTS=$MAX_RESTARTS$([ "${DS4_RESTART:-0}" = 0 ] || echo "; this is restart $DS4_RESTART")"
)
[ "$VERBOSE" = 1 ] && CONSOLE+=(--verbose)
# A rerun of a finished run: verl's sft_trainer would resume at the last step and train one step past it;
# the console says the run is complete instead (unless the overrides move the run's folder, its resume
# mode or its length: written as key=, +key=, ++key= or ~key).
finished_check=1
for arg in ${OVERRIDES[@]+"${OVERRIDES[@]}"}; do
    key=${arg#"${arg%%[!+~]*}"}   # without the leading + / ~ signs
    case "${key%%=*}" in
        trainer.default_local_dir | trainer.resume_mode | trainer.total_training_steps) finished_check=0 ;;
    esac
done
[ "$finished_check" = 1 ] && [ "$RESUME_MODE" = auto ] && [ "$NNODES" = 1 ] &&
    CONSOLE+=(--finished-check "$WORK_DIR/checkpoints")
HYDRA_ARGS=(
    engine=megatron optim=megatron
    "${DATA[@]}" "${MODEL_ARGS[@]}" "${ENGINE[@]}" "${OPTIM[@]}" "${TRAINER[@]}" ${OVERRIDES[@]+"${OVERRIDES[@]}"}
)
TORCHRUN=(
    "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NPROC" --node_rank="$NODE_RANK"
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT"
    -m verl.trainer.sft_trainer "${HYDRA_ARGS[@]}"
)

# The overrides compose with verl's SFT config and add no key that nothing reads (a typo), checked in
# seconds before torchrun starts: Hydra's error first, the closest known key, no third-party warnings.
if ! "$PYTHON" -W ignore -m verl_ds4.recipes.override_keys sft_trainer_engine --before "torchrun started" -- "${HYDRA_ARGS[@]}"; then
    exit 2
fi

# The checkpoint it would resume from, verified against its manifest in seconds before torchrun starts:
# resume_mode=auto skips a damaged one for the newest intact one (loudly), an explicit resume_from_path to
# a damaged one is refused with the file and the fix (verl_ds4.recipes.ckpt_resume). Node 0 only.
if [ "$NODE_RANK" = 0 ] && ! "$PYTHON" -W ignore -m verl_ds4.recipes.ckpt_resume -- "${HYDRA_ARGS[@]}"; then
    exit 2
fi

# The assets (data, the seeded model folder), written once the overrides passed.
ASSET_ARGS=(--out "$ASSETS" --model "$MODEL" --task "$TASK" --n-train "$N_TRAIN")
[ "$TASK" = long ] && ASSET_ARGS+=(--seq-len "$MAX_SEQ_LEN")
[ -n "$MAX_POSITIONS" ] && ASSET_ARGS+=(--max-positions "$MAX_POSITIONS")
if [ "$VERBOSE" = 1 ]; then
    "$PYTHON" -m verl_ds4.cpu.sft_data "${ASSET_ARGS[@]}"
elif ! assets_out=$("$PYTHON" -m verl_ds4.cpu.sft_data "${ASSET_ARGS[@]}" 2>&1); then
    printf '%s\n' "$assets_out" >&2   # quiet unless it fails
    echo "[verl-ds4] FAILED: writing the assets to $ASSETS" >&2
    exit 1
fi

# The length, before torchrun starts: refused above the model folder's max_position_embeddings (MAX_POSITIONS
# raises the tiny model's), and rows longer than it counted and refused by the trainer's own dataset
# (DS4ChatSFTDataset, data.truncation=error): never cut silently.
if [ -n "$MAX_SEQ_LEN" ]; then
    LENGTH_CHECK=(--max-seq-len "$MAX_SEQ_LEN" --model-dir "$ASSETS/model" --train-file "$ASSETS/data/train.parquet")
    [ -n "$MAX_POSITIONS" ] && LENGTH_CHECK+=(--max-positions "$MAX_POSITIONS")
    if ! "$PYTHON" -W ignore -m verl_ds4.cpu.long_data check "${LENGTH_CHECK[@]}" >/dev/null; then
        exit 2
    fi
fi

if [ "$NNODES" -gt 1 ]; then
    NODE_LOG="$WORK_DIR/logs/$(date +%Y%m%d-%H%M%S)$NODE_SUFFIX.log"
    if [ "$NODE_RANK" -gt 0 ]; then
        # verl prints the steps on global rank 0 (node 0): this node's console says where it is and how it ended.
        mkdir -p "$WORK_DIR/logs"
        echo "[verl-ds4] node        $NODE_RANK of $NNODES ($NPROC processes), rendezvous $MASTER_ADDR:$MASTER_PORT; steps and summary: node 0's output"
        echo "[verl-ds4] log         $NODE_LOG"
        status=0
        "${TORCHRUN[@]}" >"$NODE_LOG" 2>&1 || status=$?
        if [ "$status" != 0 ]; then
            echo "[verl-ds4] FAILED (exit $status) on node $NODE_RANK; the last 40 lines of $NODE_LOG:" >&2
            tail -n 40 "$NODE_LOG" >&2
            exit "$status"
        fi
        echo "[verl-ds4] node $NODE_RANK finished"
        exit 0
    fi
    CONSOLE+=(--fact "nodes=$NNODES x $NPROC processes; this is node 0; rendezvous $MASTER_ADDR:$MASTER_PORT" --log "$NODE_LOG")
fi

"$PYTHON" -m verl_ds4.cpu.console sft "${CONSOLE[@]}" -- "${TORCHRUN[@]}"
