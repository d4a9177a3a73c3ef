#!/usr/bin/env bash
# Tiny DeepSeek-V4 PPO with a GAE critic, or GRPO, on CPU, through verl's own main_ppo (v1 trainer, Ray).
#
#   PPO  (DS4_RL_RECIPE=ppo, default): prompts -> cpu_demo rollout (current actor weights) -> rule reward
#        -> critic values (Megatron value head) -> GAE -> actor update (PPO + KL to the reference model)
#        and critic update -> weight sync -> checkpoint
#   GRPO (DS4_RL_RECIPE=grpo): rollout.n responses per prompt -> rule reward -> group-relative advantages
#        (no critic) -> actor update (PPO clip + KL loss to the reference model) -> weight sync -> checkpoint
# Every step the mismatch gate compares the rollout's log-probs with the actor's recompute at CP (verl_ds4/rollout/mismatch_gate.py).
#
# Actor, reference and critic are the full tiny DS4 (MODEL=ds4: mHC, DS4 attention, DS4 MoE with a hash layer,
# started from the assets' DS4 checkpoint folder) or, with MODEL=ds4_proxy, the attention-only DS4 proxy, on
# verl-ds4's CPU Megatron engine, THD, context parallel size 2, contiguous layout. MODEL=ds41: the tiny DeepSeek-V4.1
# (CSA2, Engram, single-pass mHC; its V4.1 folder in our names), the critic DS41MegatronModel(value_head=True). MODEL_PATH=<HF DS4 folder>
# starts them from that folder instead (e.g. the SFT job's checkpoint converted by
# `python -m verl_ds4.cpu.sft_to_hf`; benchmarks/bench_rl_learning.sh does SFT -> convert -> RL).
# The recipes are recipes/recipe/ds4_proxy_{ppo,grpo}_cpu.yaml; every CPU-only setting is in configs/cpu/laptop.yaml.
# A test/demo: no GPU, about 2 cores and a few GB of memory; the default model is random, so do not expect
# learning from it (the learning benchmark starts from an SFT checkpoint).
#
# On a Ray cluster (RAY_ADDRESS set, as in a job that scripts/ray_cluster.sh submit started with
# DS4_DEVICE=cpu): the driver joins that cluster instead of starting one (no local logical CPU/GPU
# counts, no dashboard switch; RAY_OVERRIDE_JOB_RUNTIME_ENV=1 lets the recipe's worker env vars
# combine with the job's), and the trainer spreads over NNODES nodes x NPROC_PER_NODE processes
# (trainer.nnodes, trainer.n_gpus_per_node: the nodes' logical GPUs).
#
# Usage:  bash scripts/run_ds4_proxy_ppo_cpu.sh [--verbose] [extra Hydra overrides...]
#         DS4_RL_RECIPE=grpo bash scripts/run_ds4_proxy_ppo_cpu.sh
#
# The console is quiet (verl_ds4.cpu.console): start-up facts, one line per step with an
# ETA, and a summary table with the line `reward: first 5 steps mean A, last 5 steps mean B`; the
# per-step reward, value loss, KL and rollout/trainer mismatch are plotted to $WORK_DIR/rl_metrics.png
# (matplotlib, the `plot` extra). The full output of verl, Ray and the workers goes to
# $WORK_DIR/logs/<timestamp>.log (also logs/latest.log); VERBOSE=1 or --verbose shows it on the
# console too. On a failure the last 40 lines of that log are printed and the script exits non-zero.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# ---------------------------------- user-adjustable ----------------------------------
PYTHON=${PYTHON:-python}
DS4_RL_RECIPE=${DS4_RL_RECIPE:-ppo}     # ppo (GAE critic) | grpo (group-relative advantages, no critic)
MODEL=${MODEL:-ds4}                     # ds4 (full tiny DS4 checkpoint folder) | ds4_proxy (attention-only proxy) | ds41 (tiny DeepSeek-V4.1)
MODEL_PATH=${MODEL_PATH:-}              # an HF DS4 folder to start from (default: the assets' seeded $MODEL)
WORK_DIR=${WORK_DIR:-runs/${MODEL}_${DS4_RL_RECIPE}_cpu}
STEPS=${STEPS:-3}                       # RL steps (each: rollout, reward, [values, GAE,] updates, weight sync)
BATCH=${BATCH:-8}                       # prompts per step
MINI_BATCH=${MINI_BATCH:-$BATCH}        # prompts per actor/critic update (BATCH / MINI_BATCH updates per step)
RESPONSE_LENGTH=${RESPONSE_LENGTH:-16}  # tokens sampled per prompt (at most)
PROMPT_LENGTH=${PROMPT_LENGTH:-}        # empty: the short task (data.max_prompt_length 96); N: every prompt filled to about N
                                        # tokens with arithmetic text before its instruction (data.max_prompt_length=N)
MAX_POSITIONS=${MAX_POSITIONS:-}        # the tiny model folder's max_position_embeddings (empty: its own, 4096); prompt +
                                        # response above the model's is refused
CP=${CP:-2}                             # context-parallel size of actor, reference and critic
NNODES=${NNODES:-1}                     # Ray nodes the trainer spreads over (trainer.nnodes)
NPROC_PER_NODE=${NPROC_PER_NODE:-2}     # trainer processes per node (trainer.n_gpus_per_node, logical GPUs)
N_TRAIN=${N_TRAIN:-256}                 # prompts written to the training parquet
SAVE_FREQ=${SAVE_FREQ:-$([ "${ENGINE:-project}" = production ] && echo -1 || echo "$STEPS")}  # checkpoint every N steps
                                        # (-1: none; ENGINE=production's default, see below)
RESUME_MODE=${RESUME_MODE:-disable}     # disable | auto (continue from the latest checkpoint of this same run)
MAX_RESTARTS=${MAX_RESTARTS:-0}         # restarts from the newest intact checkpoint after the run dies (0 here: the demo
                                        # stops at the first failure; scripts/ray_cluster.sh submit defaults to 3)
RAY_WAIT_TIMEOUT=${RAY_WAIT_TIMEOUT:-600}  # on a Ray cluster of NNODES > 1: seconds a start waits for NNODES alive nodes
                                        # (a restart after a node was lost waits for its replacement)
MISMATCH_MAX=${MISMATCH_MAX:-1e-5}     # stop when rollout and actor log-probs differ by more (max abs; null: report only)
INDEXER_REPLAY=${INDEXER_REPLAY:-0}     # 1: the actor replays the rollout's indexer top-k choices (ds4, ds41;
                                        # actor_rollout_ref.actor.megatron.indexer_replay=true)
# ... on more than MISMATCH_TOKENS response tokens a step (each still <= 1e-3). ds41 without indexer replay: 2, for
# top-k near-ties (docs/troubleshooting.md, "The mismatch gate stopped the run"); otherwise 0
MISMATCH_TOKENS=${MISMATCH_TOKENS:-$([ "$MODEL" = ds41 ] && [ "$INDEXER_REPLAY" != 1 ] && echo 2 || echo 0)}
ENGINE=${ENGINE:-project}               # project: verl-ds4's CPU engine (its own DS4); production: Megatron-LM dev's DS4
                                        # built by Megatron-Bridge in verl's engine, the code a GPU run executes (MODEL=ds4,
                                        # Python 3.12 with megatron-bridge, a Megatron-LM dev export; docs/architecture.md)
VERBOSE=${VERBOSE:-0}                   # 1: verl's, Ray's and the workers' full output on the console
REWARD_RISE=${REWARD_RISE:-}            # e.g. 0.3: the summary says whether the last-5 mean reward beat the first-5 by that
# --------------------------------------------------------------------------------------

case "$DS4_RL_RECIPE" in
    ppo) RECIPE_NAME=ds4_proxy_ppo_cpu; JOB="PPO with a GAE critic"; ROLES="actor, reference, critic" ;;
    grpo) RECIPE_NAME=ds4_proxy_grpo_cpu; JOB="GRPO (group-relative advantages, no critic)"; ROLES="actor, reference" ;;
    *) echo "DS4_RL_RECIPE=$DS4_RL_RECIPE: expected ppo or grpo" >&2; exit 2 ;;
esac
case "$MODEL" in
    ds4|ds4_proxy|ds41) ;;
    *) echo "MODEL=$MODEL: expected one of the known models ds4 (the full tiny DS4, default), ds4_proxy (attention-only) or ds41 (DeepSeek-V4.1), e.g. MODEL=ds4" >&2; exit 2 ;;
esac
case "$ENGINE" in
    project) ;;
    production)
        if [ "$MODEL" != ds4 ]; then
            echo "ENGINE=production with MODEL=$MODEL: the production engine builds Megatron-LM dev's DeepSeek-V4 (MODEL=ds4)" >&2; exit 2
        fi
        if [ "$SAVE_FREQ" != -1 ] || [ "$RESUME_MODE" != disable ]; then
            echo "ENGINE=production with SAVE_FREQ=$SAVE_FREQ RESUME_MODE=$RESUME_MODE: on the CPU this engine saves no model (Megatron-Bridge's" \
                 "HF save imports NVIDIA ModelOpt, a CUDA package), so it neither checkpoints nor resumes; use SAVE_FREQ=-1" \
                 "RESUME_MODE=disable (the defaults), or ENGINE=project for checkpoints" >&2; exit 2
        fi ;;
    *) echo "ENGINE=$ENGINE: expected project (verl-ds4's CPU engine, default) or production (Megatron-LM dev's DS4 built by Megatron-Bridge)" >&2; exit 2 ;;
esac
if [ -n "$MODEL_PATH" ] && [ ! -f "$MODEL_PATH/config.json" ]; then
    echo "MODEL_PATH=$MODEL_PATH: expected an HF DS4 folder (config.json + *.safetensors + tokenizer), e.g. one written by" \
         "python -m verl_ds4.cpu.sft_to_hf --checkpoint SFT_WORK_DIR/checkpoints --model-dir SFT_WORK_DIR/assets/model --out DIR" >&2
    exit 2
fi

# verl does not check that the mini-batches tile the batch; a remainder would be trained as a smaller update.
if ! [[ "$BATCH" =~ ^[1-9][0-9]*$ && "$MINI_BATCH" =~ ^[1-9][0-9]*$ ]] || [ $((BATCH % MINI_BATCH)) != 0 ]; then
    echo "MINI_BATCH=$MINI_BATCH, BATCH=$BATCH: expected positive integers with MINI_BATCH dividing BATCH" \
         "(BATCH / MINI_BATCH actor/critic updates per step), e.g. BATCH=8 MINI_BATCH=4" >&2
    exit 2
fi

for knob in NNODES NPROC_PER_NODE CP RAY_WAIT_TIMEOUT; do
    if ! [[ ${!knob} =~ ^[1-9][0-9]*$ ]]; then
        echo "$knob=${!knob}: expected a positive integer" >&2; exit 2
    fi
done
for knob in PROMPT_LENGTH MAX_POSITIONS; do
    if [ -n "${!knob}" ] && ! [[ ${!knob} =~ ^[1-9][0-9]*$ ]]; then
        echo "$knob=${!knob}: expected a positive integer (tokens), e.g. $knob=4096" >&2; exit 2
    fi
done
if [ -n "$MAX_POSITIONS" ] && [ -n "$MODEL_PATH" ]; then
    echo "MAX_POSITIONS=$MAX_POSITIONS with MODEL_PATH=$MODEL_PATH: MAX_POSITIONS sizes the assets' tiny model only; set" \
         "max_position_embeddings in $MODEL_PATH/config.json instead" >&2; exit 2
fi
if [ $((NNODES * NPROC_PER_NODE % CP)) != 0 ]; then
    echo "CP=$CP does not divide the trainer's $((NNODES * NPROC_PER_NODE)) processes (NNODES=$NNODES x NPROC_PER_NODE=$NPROC_PER_NODE)" >&2; exit 2
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

OVERRIDES=()
for arg in "$@"; do
    case "$arg" in
        --verbose) VERBOSE=1 ;;
        *) OVERRIDES+=("$arg") ;;
    esac
done

if [ "$DS4_RL_RECIPE" = grpo ]; then
    for arg in ${OVERRIDES[@]+"${OVERRIDES[@]}"}; do
        case "${arg#"${arg%%[!+]*}"}" in   # the key without leading + signs (++key=value sets it too)
            actor_rollout_ref.rollout.n=*)
                if [ "${arg#*=}" -le 1 ] 2>/dev/null; then
                    echo "$arg: GRPO needs actor_rollout_ref.rollout.n > 1 (a group of one response has zero" \
                         "group-relative advantage); use n >= 2 (the recipe's default is 4) or DS4_RL_RECIPE=ppo" >&2
                    exit 2
                fi ;;
        esac
    done
fi

ASSETS="$WORK_DIR/assets"
# The task (its data, and its rule reward for verl's custom_reward_function) is one file, run here as a
# script: importing it as verl_ds4.rollout.demo_task would import verl first (~10 s). An assets folder
# written before with the same arguments is reused (a resumed run, a retry).
REWARD_FILE=$("$PYTHON" -c 'import importlib.util, os; s = importlib.util.find_spec("verl_ds4"); print(os.path.join(s.submodule_search_locations[0], "rollout", "demo_task.py"))')
START_MODEL=${MODEL_PATH:-$ASSETS/model}

# Read by the driver at `import verl`; configs/cpu/laptop.yaml passes them on to the Ray workers.
export VERL_PLATFORM=cpu
export VERL_USE_EXTERNAL_MODULES=verl_ds4.cpu.platform,verl_ds4.cpu.engine,verl_ds4.rollout,verl_ds4.rollout.cpu_weight_export,verl_ds4.cpu.ds4_builder,verl_ds4.cpu.ds41_builder,verl_ds4.rollout.mismatch_gate,verl_ds4.rollout.agent_loop
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=false
ENGINE_ARGS=()
ASSET_FAMILY=transformers
if [ "$ENGINE" = production ]; then
    # verl's own engine build (Megatron-Bridge -> Megatron-LM dev's DS4) for actor, reference and critic; the weight sync is
    # verl's Bridge export (HF names), which the rollout loads into the same model (verl_ds4/rollout/production_policy.py).
    # Bridge's HF save imports NVIDIA ModelOpt: no model checkpoint here (SAVE_FREQ=-1 unless set).
    if ! MEGATRON_DEV_DIR=$(VERL_USE_EXTERNAL_MODULES="" "$PYTHON" -W ignore -m verl_ds4.substitutes.megatron_dev --print-root); then
        exit 2
    fi
    export MEGATRON_DEV_DIR
    export VERL_ENGINE_VENDOR=production
    export VERL_DS4_CPU_ROLLOUT_POLICY=verl_ds4.rollout.production_policy.ProductionCPUPolicy
    export VERL_USE_EXTERNAL_MODULES=verl_ds4.cpu.platform,verl_ds4.cpu.production_engine,verl_ds4.rollout,verl_ds4.rollout.mismatch_gate,verl_ds4.rollout.agent_loop
    ASSET_FAMILY=native
    ENV_KEY=ray_kwargs.ray_init.runtime_env.env_vars
    ENGINE_ARGS=(
        "$ENV_KEY.VERL_USE_EXTERNAL_MODULES='$VERL_USE_EXTERNAL_MODULES'"
        "+$ENV_KEY.VERL_ENGINE_VENDOR=production" "+$ENV_KEY.MEGATRON_DEV_DIR=$MEGATRON_DEV_DIR"
        "+$ENV_KEY.VERL_DS4_CPU_ROLLOUT_POLICY=$VERL_DS4_CPU_ROLLOUT_POLICY"
        actor_rollout_ref.actor.megatron.use_dist_checkpointing=False
        actor_rollout_ref.ref.megatron.use_dist_checkpointing=False
        "actor_rollout_ref.actor.checkpoint.save_contents=[optimizer,extra]"
    )
    [ "$DS4_RL_RECIPE" = ppo ] && ENGINE_ARGS+=(critic.megatron.use_dist_checkpointing=False "critic.checkpoint.save_contents=[optimizer,extra]")
fi
# VERL_DS4_TEST_MODULES: test-only modules the driver and every Ray worker import too (the chaos runs' holds,
# verl_ds4/testing; with VERL_DS4_TEST_HOLD_DIR), passed on in the workers' runtime env.
if [ -n "${VERL_DS4_TEST_MODULES:-}" ]; then
    export VERL_USE_EXTERNAL_MODULES=$VERL_USE_EXTERNAL_MODULES,$VERL_DS4_TEST_MODULES
    ENV_KEY=ray_kwargs.ray_init.runtime_env.env_vars
    KEPT=()  # the production engine's own override of the list is replaced (one value per key for Hydra)
    for arg in ${ENGINE_ARGS[@]+"${ENGINE_ARGS[@]}"}; do
        [[ $arg == "$ENV_KEY.VERL_USE_EXTERNAL_MODULES="* ]] || KEPT+=("$arg")
    done
    ENGINE_ARGS=(${KEPT[@]+"${KEPT[@]}"} "$ENV_KEY.VERL_USE_EXTERNAL_MODULES='$VERL_USE_EXTERNAL_MODULES'")
    [ -n "${VERL_DS4_TEST_HOLD_DIR:-}" ] && ENGINE_ARGS+=("+$ENV_KEY.VERL_DS4_TEST_HOLD_DIR=$VERL_DS4_TEST_HOLD_DIR")
fi

RECIPE=(
    'hydra.searchpath=[pkg://verl_ds4.recipes_data,pkg://verl_ds4.configs_data]'
    +recipe="$RECIPE_NAME"
)
DATA=(
    data.train_files="$ASSETS/data/train.parquet"
    data.val_files="$ASSETS/data/val.parquet"
    data.train_batch_size="$BATCH"
    data.max_response_length="$RESPONSE_LENGTH"
    reward.custom_reward_function.path="$REWARD_FILE"
)
[ -n "$PROMPT_LENGTH" ] && DATA+=(data.max_prompt_length="$PROMPT_LENGTH")
MODEL_ARGS=(
    actor_rollout_ref.model.path="$START_MODEL"
    actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_BATCH"
    actor_rollout_ref.actor.megatron.context_parallel_size="$CP"
    actor_rollout_ref.ref.megatron.context_parallel_size="$CP"
)
[ "$DS4_RL_RECIPE" = ppo ] && MODEL_ARGS+=(critic.megatron.context_parallel_size="$CP")
case "$INDEXER_REPLAY" in
    0) ;;
    1) MODEL_ARGS+=(actor_rollout_ref.actor.megatron.indexer_replay=true) ;;
    *) echo "INDEXER_REPLAY=$INDEXER_REPLAY: expected 0 (off) or 1 (the actor replays the rollout's indexer choices)" >&2; exit 2 ;;
esac
TRAINER=(
    trainer.nnodes="$NNODES"
    trainer.n_gpus_per_node="$NPROC_PER_NODE"
    trainer.total_training_steps="$STEPS"
    trainer.save_freq="$SAVE_FREQ"
    trainer.resume_mode="$RESUME_MODE"
    trainer.default_local_dir="$WORK_DIR/checkpoints"
    trainer.v1.ds4_gated_sync.max_log_prob_diff="$MISMATCH_MAX"
    trainer.v1.ds4_gated_sync.max_tokens_above="$MISMATCH_TOKENS"
)

CLUSTER_FACT=""
if [ -n "${RAY_ADDRESS:-}" ]; then
    # Join the running cluster: ray.init refuses resource counts when connecting to one.
    TRAINER+=(ray_kwargs.ray_init.num_cpus=null ray_kwargs.ray_init.num_gpus=null ray_kwargs.ray_init.include_dashboard=null)
    export RAY_OVERRIDE_JOB_RUNTIME_ENV=1
    CLUSTER_FACT="; Ray cluster $RAY_ADDRESS"
    # Several nodes: the run needs NNODES alive nodes (a restart after a node was lost waits, up to RAY_WAIT_TIMEOUT,
    # for its replacement), and the checkpoint folder must be one folder that every node sees (a node-local disk is
    # refused here with the reason; one task on each node; verl_ds4.recipes.shared_folder, docs/checkpoints.md).
    if [ "$NNODES" -gt 1 ]; then
        "$PYTHON" scripts/ray_wait_nodes.py --nodes "$NNODES" --timeout "$RAY_WAIT_TIMEOUT" --quiet || exit 2
        "$PYTHON" -W ignore -m verl_ds4.recipes.shared_folder --ray --dir "$WORK_DIR/checkpoints" --nodes "$NNODES" || exit 2
    fi
fi

# The overrides compose with the recipe on verl's PPO config and add no key that nothing reads (a typo),
# checked in seconds before Ray starts: Hydra's error first, the closest known key, no third-party warnings.
if ! "$PYTHON" -W ignore -m verl_ds4.recipes.override_keys ppo_trainer --before "Ray started" -- "${RECIPE[@]}" \
        "${DATA[@]}" "${MODEL_ARGS[@]}" "${TRAINER[@]}" ${ENGINE_ARGS[@]+"${ENGINE_ARGS[@]}"} ${OVERRIDES[@]+"${OVERRIDES[@]}"}; then
    exit 2
fi
# The assets (data, the seeded model folder), written once the overrides passed.
ASSET_ARGS=(--out "$ASSETS" --n-train "$N_TRAIN" --model "$MODEL" --family "$ASSET_FAMILY")
[ -n "$PROMPT_LENGTH" ] && ASSET_ARGS+=(--prompt-len "$PROMPT_LENGTH")
[ -n "$MAX_POSITIONS" ] && ASSET_ARGS+=(--max-positions "$MAX_POSITIONS")
if [ "$VERBOSE" = 1 ]; then
    VERL_USE_EXTERNAL_MODULES="" "$PYTHON" "$REWARD_FILE" "${ASSET_ARGS[@]}" >/dev/null  # verl-ds4's own model writes them
elif ! assets_out=$(VERL_USE_EXTERNAL_MODULES="" "$PYTHON" "$REWARD_FILE" "${ASSET_ARGS[@]}" 2>&1); then
    printf '%s\n' "$assets_out" >&2   # quiet unless it fails
    echo "[verl-ds4] FAILED: writing the assets to $ASSETS" >&2
    exit 1
fi
# Prompt + response within the model's max_position_embeddings (the rollout's max_model_len), before Ray starts.
if [ -n "$PROMPT_LENGTH" ]; then
    if ! "$PYTHON" -m verl_ds4.cpu.long_data rl-check --prompt-len "$PROMPT_LENGTH" --response-len "$RESPONSE_LENGTH" \
            --model-dir "$START_MODEL"; then
        exit 2
    fi
fi

# Resuming: refuse at start-up, before Ray starts, a checkpoint another run wrote (a changed CP size,
# model config or task; verl_ds4/recipes/resume_check.py). The trainer checks again (the recipe's
# trainer.checkpoint_callback_class), also when the resume is asked for by an override instead.
if [ "$RESUME_MODE" != disable ]; then
    if ! check_out=$("$PYTHON" -W ignore -m verl_ds4.recipes.resume_check ppo -- "${RECIPE[@]}" "${DATA[@]}" "${MODEL_ARGS[@]}" \
            "${TRAINER[@]}" ${OVERRIDES[@]+"${OVERRIDES[@]}"} 2>&1); then
        printf '%s\n' "$check_out" >&2
        echo "[verl-ds4] FAILED: RESUME_MODE=$RESUME_MODE would resume a checkpoint in $WORK_DIR/checkpoints that another run wrote" >&2
        exit 2
    fi
    RESUME_FACT="; ${check_out##*$'\n'}"
fi

if [ -n "$MODEL_PATH" ]; then
    MODEL_FACT=(--fact "model=$MODEL_PATH (MODEL_PATH): $ROLES" --from-checkpoint)
else
    MODEL_FACT=(--fact "model=$MODEL ($ASSETS/model; ds4: the tiny DS4 checkpoint, ds4_proxy: attention-only proxy, ds41: the tiny DeepSeek-V4.1): $ROLES")
fi
CONSOLE=(
    --work-dir "$WORK_DIR" --steps "$STEPS" --algo "$DS4_RL_RECIPE"
    --fact "job=$JOB, verl.trainer.main_ppo on CPU (Ray, recipe $RECIPE_NAME)"
    "${MODEL_FACT[@]}"
    --fact "parallel=CP $CP ($ROLES), TP 1, PP 1; $NNODES node(s) x $NPROC_PER_NODE processes$CLUSTER_FACT"
    --fact "engine=$([ "$ENGINE" = production ] && echo "production (Megatron-LM dev's DS4 built by Megatron-Bridge in verl's engine, $MEGATRON_DEV_DIR; rollout: the same model, synced by Bridge's HF export)" || echo "project (verl-ds4's CPU engine and its own DS4)") (ENGINE)"
    --fact "data=$ASSETS/data/train.parquet ($N_TRAIN prompts${PROMPT_LENGTH:+ of <= $PROMPT_LENGTH tokens}), batch $BATCH (updates of $MINI_BATCH), response <= $RESPONSE_LENGTH tokens, $STEPS steps"
    --fact "gate=rollout vs actor log-probs (CP $CP) every step: stop above max abs $MISMATCH_MAX (MISMATCH_MAX)$([ "$MISMATCH_TOKENS" = 0 ] || echo " on more than $MISMATCH_TOKENS tokens, or above 1e-3 (MISMATCH_TOKENS)"); indexer replay $([ "$INDEXER_REPLAY" = 1 ] && echo on || echo off) (INDEXER_REPLAY)"
    --fact "checkpoints=$WORK_DIR/checkpoints (every $SAVE_FREQ steps, resume_mode=$RESUME_MODE${RESUME_FACT:-})"
    --fact "restarts=MAX_RESTARTS=$MAX_RESTARTS$([ "${DS4_RESTART:-0}" = 0 ] || echo "; this is restart $DS4_RESTART")"
)
[ -n "$REWARD_RISE" ] && CONSOLE+=(--reward-rise "$REWARD_RISE")
[ "$VERBOSE" = 1 ] && CONSOLE+=(--verbose)

"$PYTHON" -m verl_ds4.cpu.console ppo "${CONSOLE[@]}" -- \
    "$PYTHON" -m verl.trainer.main_ppo "${RECIPE[@]}" "${DATA[@]}" "${MODEL_ARGS[@]}" "${TRAINER[@]}" ${ENGINE_ARGS[@]+"${ENGINE_ARGS[@]}"} \
    ${OVERRIDES[@]+"${OVERRIDES[@]}"}
