#!/usr/bin/env bash
# A run that learns: SFT on the CPU RL task's demonstrations -> HF hand-over -> PPO (GAE critic) and GRPO.
#
#   1. SFT   scripts/run_ds4_proxy_sft_cpu.sh with TASK=digits ("Repeat the digit 7." -> "7777"): the tiny
#            full DS4 through verl's SFT trainer at CP=2, only briefly (SFT_STEPS), so that the policy has
#            the format but often the wrong digit: RL has room to raise the reward.
#   2. hand-over  python -m verl_ds4.cpu.sft_to_hf: the SFT's last Megatron dist-checkpoint -> an HF DS4
#            (or V4.1) folder ($WORK_DIR/sft_hf: config.json + model.safetensors + tokenizer + generation_config.json
#            with DS4's end-of-sentence token as an EOS id), read as actor_rollout_ref.model.path.
#   3. its reward before RL (benchmarks/rl_task_reward.py, sampled like the cpu_demo rollout).
#   4. RL    scripts/run_ds4_proxy_ppo_cpu.sh with MODEL_PATH=$WORK_DIR/sft_hf, DS4_RL_RECIPE=ppo and =grpo,
#            RL_STEPS steps each, with the learning knobs below (the CI defaults stay as they are).
#            Each run's console ends with the summary table, the line
#            `reward: first 5 steps mean A, last 5 steps mean B` and a verdict against REWARD_RISE; its
#            reward / value loss / KL / mismatch plot is $WORK_DIR/<algo>/rl_metrics.png.
#
# MODEL=ds4 (default: the full tiny DS4) or MODEL=ds41 (the tiny DeepSeek-V4.1: the hand-over writes a V4.1
# folder in our names, verl_ds4.models.ds41.folder); SFT, hand-over and RL all use it.
#
# Usage:  bash benchmarks/bench_rl_learning.sh                       # SFT (once), then PPO and GRPO
#         MODEL=ds41 bash benchmarks/bench_rl_learning.sh            # the same on DeepSeek-V4.1
#         ALGOS=grpo bash benchmarks/bench_rl_learning.sh            # one of them
#         RESULTS=benchmarks/results bash benchmarks/bench_rl_learning.sh   # also copy summaries + PNGs there
# Extra arguments are Hydra overrides for both RL runs. The SFT and its hand-over are reused when
# $WORK_DIR/sft_hf exists (FRESH_SFT=1 redoes them). Exit status: 0 when every RL run met REWARD_RISE.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# ---------------------------------- user-adjustable ----------------------------------
PYTHON=${PYTHON:-python}
MODEL=${MODEL:-ds4}                     # ds4 | ds41 (the SFT, its hand-over and both RL runs)
WORK_DIR=${WORK_DIR:-runs/rl_learning$([ "$MODEL" = ds4 ] || echo "_$MODEL")}
ALGOS=${ALGOS:-ppo grpo}                # which RL runs, in order
# Per-model defaults of the knobs below (each still overridable by its own variable):
# - SFT steps, brief on purpose (see above). ds4: mean reward 0.14 after 20 steps, 0.38 after 40, 0.72
#   after 60; ds41 learns the format sooner: 0.21 after 20 steps, 0.59 after 35 (64 prompts, rl_task_reward.py).
# - ds41's GRPO takes 64 prompts (updates of 16): with 32 x 4 it rose +0.19 to +0.29 at lr 5e-4 to 1.5e-3
#   (and +0.25 with 16 x 8): V4.1 needs more distinct prompts a step; 64 x 4 gave +0.64.
# - ds41's actor lr is 1e-3: at 2e-3 its GRPO stayed flat, +0.025, and KL to the reference rose to 0.6-0.9
#   within 15 steps.
if [ "$MODEL" = ds41 ]; then
    MODEL_SFT_STEPS=25 MODEL_GRPO_BATCH=64 MODEL_GRPO_MINI=16 MODEL_ACTOR_LR=1e-3
else
    MODEL_SFT_STEPS=35 MODEL_GRPO_BATCH=32 MODEL_GRPO_MINI=8 MODEL_ACTOR_LR=2e-3
fi
SFT_STEPS=${SFT_STEPS:-$MODEL_SFT_STEPS}
SFT_LR=${SFT_LR:-3e-3}
RL_STEPS=${RL_STEPS:-60}
PPO_BATCH=${PPO_BATCH:-128}             # prompts per PPO step (one response each) ...
PPO_MINI=${PPO_MINI:-32}                # ... in updates of PPO_MINI prompts (actor and critic: 4 a step)
GRPO_BATCH=${GRPO_BATCH:-$MODEL_GRPO_BATCH}  # prompts per GRPO step ...
GRPO_N=${GRPO_N:-4}                     # ... times GRPO_N responses each ...
GRPO_MINI=${GRPO_MINI:-$MODEL_GRPO_MINI}     # ... in actor updates of GRPO_MINI prompts x GRPO_N responses (4 a step)
RESPONSE_LENGTH=${RESPONSE_LENGTH:-8}   # the demonstrations are 3-6 digits + EOS
ACTOR_LR=${ACTOR_LR:-$MODEL_ACTOR_LR}
CRITIC_LR=${CRITIC_LR:-3e-3}
KL_COEF=${KL_COEF:-0.01}                # KL-to-reference loss coefficient (low_var_kl)
ENTROPY_COEF=${ENTROPY_COEF:-0.01}      # entropy bonus: without it the first digit's choice collapsed (entropy
                                        # 1.9 -> 0.1 nats in 25 steps) before it learned to follow the prompt
REWARD_RISE=${REWARD_RISE:-0.3}         # the bar: last-5 mean reward - first-5 mean reward
FRESH_SFT=${FRESH_SFT:-0}
RESULTS=${RESULTS:-}                    # a folder to copy each run's summary and PNG to
# --------------------------------------------------------------------------------------

case "$MODEL" in
    ds4|ds41) ;;
    *) echo "MODEL=$MODEL: expected ds4 or ds41 (the models with a hand-over folder; ds4_proxy has no HF weights)" >&2; exit 2 ;;
esac
SUFFIX=$([ "$MODEL" = ds4 ] || echo "_$MODEL")   # result files: rl_learning_<algo>.txt (ds4), rl_learning_ds41_<algo>.txt
if [ -f "$WORK_DIR/sft_hf/config.json" ] && [ "$FRESH_SFT" != 1 ] \
        && ! grep -q "\"model_type\": *\"$("$PYTHON" -c "from verl_ds4.cpu.sft_to_hf import MODEL_KINDS; print(MODEL_KINDS['$MODEL'])")\"" "$WORK_DIR/sft_hf/config.json"; then
    echo "MODEL=$MODEL: $WORK_DIR/sft_hf is the hand-over of another model; set FRESH_SFT=1 or another WORK_DIR" >&2; exit 2
fi
export PYTHON MODEL
mkdir -p "$WORK_DIR"
WORK_DIR=$(cd "$WORK_DIR" && pwd)
SFT_DIR="$WORK_DIR/sft"
HF_DIR="$WORK_DIR/sft_hf"
note() { printf '[bench-rl] %s\n' "$*"; }
load() { uptime | sed 's/.*load average: /load /'; }

if [ "$FRESH_SFT" = 1 ] || [ ! -f "$HF_DIR/config.json" ]; then
    rm -rf "$SFT_DIR" "$HF_DIR"
    note "1/3 SFT on the RL task's demonstrations: $SFT_STEPS steps, lr $SFT_LR ($(load))"
    t0=$(date +%s)
    TASK=digits STEPS="$SFT_STEPS" SAVE_FREQ="$SFT_STEPS" LR="$SFT_LR" RESUME_MODE=disable WORK_DIR="$SFT_DIR" \
        bash scripts/run_ds4_proxy_sft_cpu.sh
    note "SFT took $(( $(date +%s) - t0 )) s"
    note "2/3 hand-over: the SFT's Megatron checkpoint -> HF DS4 folder $HF_DIR"
    "$PYTHON" -m verl_ds4.cpu.sft_to_hf --checkpoint "$SFT_DIR/checkpoints" --model-dir "$SFT_DIR/assets/model" --out "$HF_DIR" \
        --model "$MODEL" 2>/dev/null
    "$PYTHON" benchmarks/rl_task_reward.py --model "$SFT_DIR/assets/model" --model "$HF_DIR" \
        --max-tokens "$RESPONSE_LENGTH" --json "$WORK_DIR/start_reward.json" 2>/dev/null | grep ': mean reward ' \
        | sed 's/^/[bench-rl] reward before RL: /'
else
    note "1-2/3 reusing the SFT hand-over $HF_DIR (FRESH_SFT=1 redoes it)"
fi

status=0
for algo in $ALGOS; do
    case "$algo" in
        ppo) BATCH=$PPO_BATCH; MINI=$PPO_MINI; EXTRA=(critic.optim.lr="$CRITIC_LR") ;;
        grpo) BATCH=$GRPO_BATCH; MINI=$GRPO_MINI; EXTRA=(actor_rollout_ref.rollout.n="$GRPO_N") ;;
        *) echo "ALGOS: $algo is not ppo or grpo" >&2; exit 2 ;;
    esac
    note "3/3 $algo from the SFT hand-over: $RL_STEPS steps, batch $BATCH (updates of $MINI), response <= $RESPONSE_LENGTH ($(load))"
    for attempt in 1 2; do
        t0=$(date +%s)
        set +e
        DS4_RL_RECIPE=$algo MODEL_PATH="$HF_DIR" WORK_DIR="$WORK_DIR/$algo" STEPS="$RL_STEPS" SAVE_FREQ="$RL_STEPS" \
            BATCH="$BATCH" MINI_BATCH="$MINI" RESPONSE_LENGTH="$RESPONSE_LENGTH" REWARD_RISE="$REWARD_RISE" N_TRAIN=512 \
            bash scripts/run_ds4_proxy_ppo_cpu.sh \
            actor_rollout_ref.actor.optim.lr="$ACTOR_LR" actor_rollout_ref.actor.kl_loss_coef="$KL_COEF" \
            actor_rollout_ref.actor.entropy_coeff="$ENTROPY_COEF" \
            "${EXTRA[@]}" "$@" | tee "$WORK_DIR/$algo.console.txt"
        rc=${PIPESTATUS[0]}
        set -e
        # Ray gives its raylet a fixed 30 s to register; on an overloaded machine that start-up can fail.
        if [ "$rc" != 0 ] && [ "$attempt" = 1 ] && grep -q "The current node timed out during startup" \
                "$WORK_DIR/$algo/logs/latest.log" 2>/dev/null; then
            note "$algo: Ray's node start-up timed out (machine overloaded: $(load)); trying once more"
            continue
        fi
        break
    done
    wall=$(( $(date +%s) - t0 ))
    end_load=$(load)
    note "$algo: exit $rc, wall time ${wall} s ($end_load at the end)" | tee -a "$WORK_DIR/$algo.console.txt"
    grep -q "result      LEARNED" "$WORK_DIR/$algo.console.txt" || status=1
    if [ -n "$RESULTS" ]; then
        mkdir -p "$RESULTS"
        cp "$WORK_DIR/$algo.console.txt" "$RESULTS/rl_learning${SUFFIX}_$algo.txt"
        [ -f "$WORK_DIR/$algo/rl_metrics.png" ] && cp "$WORK_DIR/$algo/rl_metrics.png" "$RESULTS/rl_learning${SUFFIX}_$algo.png"
    fi
done
exit $status
