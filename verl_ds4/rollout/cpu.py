"""``rollout.name=cpu_demo``: a test/demo rollout for verl's v1 trainer that samples on the CPU.

verl 0.9.1's rollouts (vLLM, SGLang, TensorRT-LLM) need GPUs, and its ``hf_rollout`` / ``naive``
rollouts are not used by the v1 trainer's agent loop. This rollout lets the whole RL loop
(rollout -> reward -> values -> GAE -> updates -> weight sync) run on a laptop:

* :class:`CPURolloutServer` - the Ray actor the agent loop talks to (token in, token out):
  ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput`` samples from a
  :class:`~verl_ds4.rollout.policy.MegatronCPUPolicy`. Requests are batched continuously: each
  decode step runs one packed THD forward over every active request (at most
  ``rollout.max_num_batched_tokens`` rows a forward, ``rollout.max_num_seqs`` requests at once) and
  samples one token for each with that request's own seeded generator; new requests join at the next
  step. There is no KV cache: every step recomputes the whole sequences, exactly the forward the
  actor recomputes the log-probs with. ``update_weights`` loads the actor's weights (queued behind
  the requests sent before it, so a response never mixes two weight versions); the trainer's
  control calls (``wake_up``, ``sleep``, ``abort_all_requests``, ...) are no-ops because nothing is
  paged in or out.
* :class:`CPUServerAdapter` - the ``BaseRollout`` each actor rank holds (``_ROLLOUT_REGISTRY``):
  every step the worker hands it the actor's ``(name, tensor)`` export; every rank drains the
  generator (an export may involve collectives), rollout rank 0 sends the tensors to its server.
* :class:`CPURolloutReplica` - the ``RolloutReplica`` (``RolloutReplicaRegistry``) whose
  ``launch_servers`` starts one server actor per replica.

It refuses to run where CUDA is available: it is far too slow for real training, and a GPU run
must use vLLM or SGLang. :func:`verl_ds4.rollout.register` makes verl know the name.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Generator, Optional

import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl_ds4.mcore.indexer_replay import FIELD as INDEXER_FIELD
from verl_ds4.rollout import ROLLOUT_NAME, SEEDED_AGENT_LOOP

logger = logging.getLogger(__name__)

SERVER_NAME_PREFIX = "verl_ds4_cpu_demo_server"
# Policy used when the config does not name one: the actor's Megatron model on one CPU rank.
DEFAULT_POLICY = "verl_ds4.rollout.policy.MegatronCPUPolicy"
# Env var naming another policy class (module.Class) with the same interface (tests).
ENV_POLICY = "VERL_DS4_CPU_ROLLOUT_POLICY"
# TEST ONLY (the mismatch gate's negative control): the global step whose weight sync the server skips.
ENV_TEST_SKIP_SYNC = "VERL_DS4_TEST_SKIP_WEIGHT_SYNC_AT_STEP"

__all__ = [
    "ROLLOUT_NAME",
    "CPURolloutReplica",
    "CPURolloutServer",
    "CPUServerAdapter",
    "refuse_cuda",
    "check_request_ids",
    "request_seed",
    "sample_next_token",
    "server_actor_name",
]


def refuse_cuda(where: str) -> None:
    """Raise if CUDA devices are visible: this rollout is for CPU tests and demos only."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        raise RuntimeError(
            f"rollout.name={ROLLOUT_NAME!r} ({where}) is a CPU test/demo rollout (no KV cache) and refuses "
            f"to run where CUDA devices are visible ({torch.cuda.device_count()} found). On GPUs set "
            "actor_rollout_ref.rollout.name=vllm (or sglang)."
        )


def server_actor_name(replica_rank: int, name_suffix: str = "") -> str:
    """The Ray actor name of replica ``replica_rank``'s server (the adapter looks it up by name)."""
    return f"{SERVER_NAME_PREFIX}_{replica_rank}{name_suffix}"


def sample_next_token(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator
) -> tuple[int, float]:
    """``(token, log-prob)`` from float logits ``[vocab]``.

    ``temperature <= 0`` is greedy (log-prob of the raw distribution); otherwise the logits are
    divided by the temperature, cut to the ``top_k`` largest (``top_k <= 0``: all) and to the
    smallest set whose probability reaches ``top_p``, and sampled; the log-prob is that of the
    token under the temperature-scaled distribution before the cuts (what the actor recomputes).
    """
    logits = logits.float()
    if temperature <= 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    scaled = logits / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    masked = scaled.clone()
    if 0 < top_k < masked.numel():
        kth = torch.topk(masked, top_k).values[-1]
        masked[masked < kth] = float("-inf")
    if 0.0 < top_p < 1.0:
        probs = torch.softmax(masked, dim=-1)
        order = torch.argsort(probs, descending=True)
        cumulative = torch.cumsum(probs[order], dim=0)
        drop = cumulative - probs[order] >= top_p  # keep the first token that reaches top_p
        masked[order[drop]] = float("-inf")
    probs = torch.softmax(masked, dim=-1)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])


# verl's agent loops name requests "det-<priority>" under rollout.full_determinism (else a uuid).
DETERMINISTIC_REQUEST_PREFIX = "det-"
# verl's single-turn agent loop: in the v1 trainer it gets no priority, so all its requests are "det-0".
VERL_SINGLE_TURN_AGENT = "single_turn_agent"


def check_request_ids(config) -> None:
    """Refuse, at start-up, a seeded rollout whose requests would all share one id (and so one seed).

    Under ``full_determinism`` the request id is the seed (:func:`request_seed`). verl's ``single_turn_agent``
    names it ``det-<priority>``, and verl's v1 trainer (TransferQueue agent loop) passes no priority: every
    request of a step is ``det-0``, every response is sampled with the same random numbers, and a GRPO group's
    responses are identical (zero advantages). :mod:`verl_ds4.rollout.agent_loop` gives each response its own id.
    """
    default_loop = getattr(getattr(config, "agent", None), "default_agent_loop", VERL_SINGLE_TURN_AGENT)  # verl's default
    if getattr(config, "full_determinism", False) and default_loop == VERL_SINGLE_TURN_AGENT:
        raise ValueError(
            f"rollout.name={ROLLOUT_NAME!r} with actor_rollout_ref.rollout.full_determinism=true and verl's "
            f"default_agent_loop={VERL_SINGLE_TURN_AGENT!r}: in verl's v1 trainer that agent loop names every request "
            "'det-0', so every response of a step would be sampled with the same seed (a GRPO group's responses "
            "identical, every advantage 0). Set actor_rollout_ref.rollout.agent.default_agent_loop="
            f"{SEEDED_AGENT_LOOP} and add verl_ds4.rollout.agent_loop to VERL_USE_EXTERNAL_MODULES (the CPU recipes "
            "do both), or set full_determinism=false (random ids: not reproducible)."
        )


def request_seed(rollout_seed: int, weight_version: Optional[int], request_id: str) -> int:
    """The sampling seed of one request: a pure function of the rollout seed, the weight version
    (``global_steps`` of the last weight sync: the PPO step before the one sampling) and the request id.

    Nothing in it depends on the process's history, so a run resumed from a checkpoint samples
    step N exactly as an uninterrupted run does (the resumed trainer syncs the checkpoint's weights
    with the checkpoint's ``global_steps``), and the same prompt index samples differently at every step.
    """
    version = -1 if weight_version is None else int(weight_version)
    digest = hashlib.sha256(f"{int(rollout_seed)}/{version}/{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _load_class(path: str):
    import importlib

    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"expected a 'module.Class' path for the CPU rollout policy, got {path!r}")
    return getattr(importlib.import_module(module_name), class_name)


def _eos_token_ids(model_config) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model_config, "generation_config", None), getattr(model_config, "hf_config", None)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    tokenizer = getattr(model_config, "tokenizer", None)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


@dataclass(eq=False)
class _Request:
    """One generate call in the scheduler: its prompt, sampling settings and what it has sampled so far."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    want_logprobs: bool
    ignore_eos: bool
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    future: Any = None
    choices: Any = None  # indexer replay: [rows run so far, layers, index_topk] int32 (verl_ds4.mcore.indexer_replay)


@dataclass(eq=False)
class _WeightJob:
    weights: list
    global_steps: Optional[int]
    future: Any = None


class CPURolloutServer:
    """The rollout server (a Ray actor in a run; a plain object in unit tests).

    Args:
        config: the rollout config (``RolloutConfig`` or its DictConfig).
        model_config: the actor's model config (``HFModelConfig`` or its DictConfig; any object with
            ``hf_config`` and optionally ``tokenizer`` / ``generation_config`` is used as is).
        replica_rank: this server's replica.
        policy: optional policy object (tests); by default the class named by
            ``$VERL_DS4_CPU_ROLLOUT_POLICY`` or :data:`DEFAULT_POLICY`, built from ``model_config.hf_config``.
    """

    def __init__(self, config, model_config, replica_rank: int = 0, policy: Any = None):
        from omegaconf import DictConfig
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig, RolloutConfig

        refuse_cuda("server")
        if not isinstance(config, RolloutConfig):
            config = omega_conf_to_dataclass(config, dataclass_type=RolloutConfig)
        check_request_ids(config)
        self.config = config
        if isinstance(model_config, (dict, DictConfig)):
            model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.model_config = model_config
        self.replica_rank = replica_rank
        if policy is None:
            torch.set_num_threads(max(1, int(os.environ.get("VERL_DS4_CPU_ROLLOUT_THREADS", "1"))))
            policy_cls = _load_class(os.environ.get(ENV_POLICY, DEFAULT_POLICY))
            policy = policy_cls(model_config.hf_config)
        self.policy = policy
        # rollout.custom.indexer_replay (the recipes set it from actor_rollout_ref.actor.megatron.indexer_replay):
        # record every row's indexer top-k choices and return them in TokenOutput.extra_fields["indexer_topk"].
        self.record_indexer = bool((getattr(config, "custom", None) or {}).get("indexer_replay", False))
        self.eos_token_ids = _eos_token_ids(model_config)
        self.global_steps: Optional[int] = None
        self.num_weight_updates = 0
        # The scheduler (see _run): FIFO of requests and weight updates, drained by one task at a time.
        self.max_batch_tokens = max(1, int(getattr(config, "max_num_batched_tokens", 0) or 8192))
        self.max_num_seqs = max(1, int(getattr(config, "max_num_seqs", 0) or 1024))
        self.admission_wait_s = 0.01
        self._queue: collections.deque = collections.deque()
        self._running = False
        self.num_forwards = 0  # packed forwards run (a request of n tokens alone takes n)
        self.max_active = 0  # most requests decoded together
        self._warned_random_ids = False
        logger.info(
            "verl-ds4 %s rollout server %d ready (eos ids %s; code from %s)", ROLLOUT_NAME, replica_rank,
            sorted(self.eos_token_ids), os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )

    # -- token in, token out ----------------------------------------------------------------

    def _max_tokens(self, prompt_len: int, sampling_params: dict) -> int:
        for key in ("max_tokens", "max_new_tokens"):
            if key in sampling_params:
                requested = int(sampling_params.pop(key))
                break
        else:
            requested = min(
                self.config.response_length, self.config.prompt_length + self.config.response_length - prompt_len
            )
        budget = self.config.prompt_length + self.config.response_length - prompt_len
        if budget < 1:
            raise ValueError(
                f"prompt of {prompt_len} tokens leaves no room for a response within prompt_length + response_length "
                f"= {self.config.prompt_length + self.config.response_length}."
            )
        return max(1, min(requested, budget))

    def _generator(self, request_id: str, sampling_params: dict) -> torch.Generator:
        """A generator of its own per request: the request's ``seed`` when it has one, else
        :func:`request_seed` of the rollout seed, the weight version and the request id."""
        seed = sampling_params.get("seed")
        if seed is None:
            if not str(request_id).startswith(DETERMINISTIC_REQUEST_PREFIX) and not self._warned_random_ids:
                self._warned_random_ids = True
                logger.warning(
                    "verl-ds4 %s rollout: request id %r is random (actor_rollout_ref.rollout.full_determinism=false), "
                    "so sampling is not reproducible and a resumed run will not repeat an uninterrupted one; set "
                    "actor_rollout_ref.rollout.full_determinism=true for request ids 'det-<n>' (with the agent loop %s).",
                    ROLLOUT_NAME, request_id, SEEDED_AGENT_LOOP,
                )
            seed = request_seed(int(self.config.seed or 0), self.global_steps, request_id)
        return torch.Generator().manual_seed(int(seed))

    def _request(self, prompt_ids: list[int], sampling_params: dict, request_id: str) -> "_Request":
        params = dict(sampling_params or {})
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("generate needs a non-empty prompt_ids.")  # error-catalogue: internal: verl sent an empty request
        max_tokens = self._max_tokens(len(prompt), params)
        return _Request(
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=float(params.get("temperature", 1.0) or 0.0),
            top_k=int(params.get("top_k", -1) if params.get("top_k") is not None else -1),
            top_p=float(params.get("top_p", 1.0) if params.get("top_p") is not None else 1.0),
            want_logprobs=bool(params.get("logprobs", False)),
            ignore_eos=bool(params.get("ignore_eos", False)),
            generator=self._generator(request_id, params),
        )

    def _output(self, request: "_Request") -> TokenOutput:
        return TokenOutput(
            token_ids=request.tokens,
            log_probs=request.logprobs if request.want_logprobs else None,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps}
            | ({INDEXER_FIELD: request.choices} if request.choices is not None else {}),
        )

    def decode_step(self, requests: list["_Request"]) -> None:
        """One token for each unfinished request: packed forwards of at most ``max_batch_tokens`` rows each."""
        chunk: list[_Request] = []
        rows = 0
        for request in requests + [None]:
            length = 0 if request is None else len(request.prompt) + len(request.tokens)
            if chunk and (request is None or rows + length > self.max_batch_tokens):
                if self.record_indexer:  # earlier rows replay what they chose at earlier steps (a KV cache keeps them)
                    logits, choices = self.policy.next_token_logits_and_choices(
                        [r.prompt + r.tokens for r in chunk], [r.choices for r in chunk]
                    )
                    for r, rows in zip(chunk, choices):
                        r.choices = rows
                else:
                    logits = self.policy.next_token_logits_batch([r.prompt + r.tokens for r in chunk])
                self.num_forwards += 1
                for r, row in zip(chunk, logits):
                    token, logprob = sample_next_token(row, r.temperature, r.top_k, r.top_p, r.generator)
                    r.tokens.append(token)
                    r.logprobs.append(logprob)
                    r.done = len(r.tokens) >= r.max_tokens or (token in self.eos_token_ids and not r.ignore_eos)
                chunk, rows = [], 0
            if request is not None:
                chunk.append(request)
                rows += length

    def generate_sync(self, prompt_ids: list[int], sampling_params: dict, request_id: str) -> TokenOutput:
        """Sample a response for one prompt, on its own (the batched path runs the same steps)."""
        request = self._request(prompt_ids, sampling_params, request_id)
        while not request.done:
            self.decode_step([request])
        return self._output(request)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Optional[list[Any]] = None,
        video_data: Optional[list[Any]] = None,
        **kwargs: Any,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise ValueError(f"rollout.name={ROLLOUT_NAME!r} generates text only; this request carries media.")
        request = self._request(prompt_ids, sampling_params, request_id)
        await self._submit(request)
        return self._output(request)

    # -- the scheduler: requests that arrive together are decoded together ---------------------

    async def _submit(self, job: "_Request | _WeightJob"):
        job.future = asyncio.get_running_loop().create_future()
        self._queue.append(job)
        if not self._running:
            self._running = True
            asyncio.get_running_loop().create_task(self._run())
        return await job.future

    async def _run(self) -> None:
        """Continuous batching: every decode step takes every active request one token further in one
        packed forward; new requests join at the next step. A weight update waits until the requests
        queued before it have finished, and requests queued after it wait for the update (FIFO), so
        one response is always sampled from one set of weights."""
        active: list[_Request] = []
        try:
            await asyncio.sleep(self.admission_wait_s)  # let requests sent together arrive together
            while True:
                while self._queue and isinstance(self._queue[0], _Request) and len(active) < self.max_num_seqs:
                    active.append(self._queue.popleft())
                if active:
                    self.max_active = max(self.max_active, len(active))
                    try:
                        await asyncio.to_thread(self.decode_step, active)
                    except BaseException as err:  # every waiting request gets the error
                        for request in active:
                            if not request.future.done():
                                request.future.set_exception(err)
                        active = []
                        if not isinstance(err, Exception):
                            raise
                        continue
                    for request in active:
                        if request.done and not request.future.done():  # (a cancelled caller's is done)
                            request.future.set_result(None)
                    active = [r for r in active if not r.done and not r.future.done()]
                    continue
                if not self._queue:
                    break
                job = self._queue.popleft()  # a weight update, after every earlier request finished
                try:
                    loaded = await asyncio.to_thread(self._load_weights, job)
                except Exception as err:
                    if not job.future.done():
                        job.future.set_exception(err)
                else:
                    if not job.future.done():
                        job.future.set_result(loaded)
        finally:
            self._running = False
            for job in list(active) + list(self._queue):
                if job.future is not None and not job.future.done():
                    job.future.set_exception(RuntimeError("the CPU rollout's scheduler stopped"))
            self._queue.clear()

    # -- weights --------------------------------------------------------------------------

    def _load_weights(self, job: "_WeightJob") -> int:
        skip = os.environ.get(ENV_TEST_SKIP_SYNC, "").strip()
        if skip and job.global_steps is not None and int(skip) == int(job.global_steps):
            logger.warning(
                "verl-ds4 %s rollout: TEST SWITCH %s=%s: NOT loading the actor's weights synced at global step %s "
                "(negative control of the rollout/actor mismatch gate)", ROLLOUT_NAME, ENV_TEST_SKIP_SYNC, skip,
                job.global_steps,
            )
            return 0
        return self.policy.load_weights(job.weights)

    async def update_weights(self, weights: list[tuple[str, torch.Tensor]], global_steps: Optional[int] = None) -> int:
        """Load the actor's weights (all of them, every step); returns how many tensors were loaded."""
        count = await self._submit(_WeightJob(weights=weights, global_steps=global_steps))
        self.num_weight_updates += 1
        if global_steps is not None:
            self.global_steps = global_steps
        return count

    async def get_stats(self) -> dict[str, Any]:
        return {
            "num_weight_updates": self.num_weight_updates,
            "global_steps": self.global_steps,
            "replica_rank": self.replica_rank,
        }

    # -- control methods: nothing to page in or out on a CPU --------------------------------

    async def wake_up(self):
        pass

    async def sleep(self):
        pass

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        # Requests run to completion one at a time; there is nothing partial to abort.
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self):
        pass

    async def clear_kv_cache(self):
        pass

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def start_profile(self, **kwargs):
        pass

    async def stop_profile(self):
        pass


class CPUServerAdapter(BaseRollout):
    """The per-actor-rank client of the CPU rollout server (verl's ``BaseRollout`` for ``cpu_demo``)."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        refuse_cuda("server adapter")
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.server_handle = None

    def _server(self):
        if self.rollout_rank != 0:
            return None
        if self.server_handle is None:
            import ray

            self.server_handle = ray.get_actor(server_actor_name(self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]):
        pass  # weights and "KV cache" live in the server process on the CPU; nothing to page in

    async def release(self):
        pass

    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        wire_format: str = "named_tensors",
        global_steps: Optional[int] = None,
        peft_config: Any = None,
        **kwargs,
    ):
        if wire_format != "named_tensors":
            raise ValueError(
                f"rollout.name={ROLLOUT_NAME!r} takes full named tensors; got wire_format={wire_format!r}. "
                "Use actor_rollout_ref.rollout.checkpoint_engine.backend=naive."
            )
        if peft_config is not None:
            raise ValueError(f"rollout.name={ROLLOUT_NAME!r} does not load LoRA adapters; merge them (lora.merge=True).")
        server = self._server()
        # Every rank drains the export (it may run collectives); rank 0 of the replica keeps it.
        if server is None:
            for _ in weights:
                pass
            return
        collected = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights]
        await server.update_weights.remote(collected, global_steps=global_steps)


class CPURolloutReplica(RolloutReplica):
    """One CPU rollout server per replica, started next to the replica's first trainer worker."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        import ray

        refuse_cuda("replica")
        server_cls = ray.remote(CPURolloutServer)
        options: dict[str, Any] = {
            "name": server_actor_name(self.replica_rank, self.name_suffix),
            "max_concurrency": self.max_concurrency,
            "num_cpus": 0,  # the trainer workers hold the logical CPUs/GPUs; the server only waits on them
        }
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
            options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False
            )
        env = {key: os.environ[key] for key in ("VERL_PLATFORM", ENV_POLICY, ENV_TEST_SKIP_SYNC) if key in os.environ}
        if env:
            options["runtime_env"] = {"env_vars": env}
        server = server_cls.options(**options).remote(
            config=self.config, model_config=self.model_config, replica_rank=self.replica_rank
        )
        await server.get_stats.remote()  # wait until it has built its model; raises its start-up error
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{ROLLOUT_NAME}-replica-{self.replica_rank}{self.name_suffix}"
