"""The embedded default: SmolLM2-135M-Instruct solves built-in arithmetic word problems with a calculator.

    python -m steprl_jax.main --config=configs/demo.py --config.task.num_tasks=8
    python -m steprl_jax.main --config=configs/demo.py --config.task.name=gsm8k --config.task.path=PATH
"""
from ml_collections import ConfigDict


def get_config(arg=None):
    c = ConfigDict()
    c.job = "evaluate"  # evaluate | swirl
    c.workdir = "runs/demo"
    c.seed = 0
    # float32 on CPU, the setting every recorded demo run used. bf16 decodes faster at batch >= 8
    # and, beside a padding row (Sampler.min_decode_batch), at batch 1 too; not measured on this
    # job. bfloat16 on TPU/GPU.
    c.model = ConfigDict(dict(source="smollm2-135m-instruct", compute_dtype="float32"))
    # name: arithmetic (built in) | gsm8k | hotpotqa | toolworld
    # latency_min_s / latency_max_s: the tool world's calls each take a duration drawn from this
    # range (a service's response time, e.g. for benchmarks of asynchronous rollouts).
    # seed: the generated tasks' (the built-in arithmetic problems, the tool world's query splits),
    # not the run's: runs of several seeds train and evaluate on the same questions.
    c.task = ConfigDict(dict(name="arithmetic", path="", split="test", num_tasks=16, offset=0, seed=0, world_seed=0,
                             failure_rate=0.0, latency_min_s=0.0, latency_max_s=0.0, corpus_path="",
                             search_top_k=1))
    # format: tags (SWiRL) | tool_call (PORTool); tools for the tag format.
    # few_shot: worked examples shown before each question (math tasks).
    c.env = ConfigDict(dict(format="tags", tools=("calculator",), invalid_action="error_observation", few_shot=2))
    c.rollout = ConfigDict(dict(
        episodes_per_task=1, max_steps=5, max_new_tokens=96, max_context=1024, batch_size=16,
        temperature=0.7, top_k=0, top_p=1.0, tool_workers=16, tool_timeout_s=10.0,
        # a tool result longer than this many characters reaches the agent (and the records) cut,
        # ending "... [truncated: N more characters]"
        max_result_chars=4000,
        # continuous batching of independent episodes: a finished episode's row takes the next one
        # and the decode returns every decode_chunk tokens or when an action ends
        continuous=True, decode_chunk=16,
        # wait for every tool call of a generation call before the next one: runs and resumed runs
        # reproduce exactly; False overlaps slow tools (seconds each) with the other rows' decoding
        deterministic=True,
        # trees (PORTool): n leaves per task, branching factor f, schedule static | resample
        tree=ConfigDict(dict(enabled=False, n=8, f=2, schedule="static", fork_depths=(1, 2, 3)))))
    # kind: rule | local | http  (model judges take base_url/model/api_key_env/votes/cache_dir).
    # process.kind may also be "reference": the math tasks' reference-guided step judge, which sees
    # the golden solution; an experiment's stand-in for a strong LLM judge, never SWiRL's default
    # (evaluation reports its verdicts beside the process judge's in any case).
    c.judge = ConfigDict(dict(
        outcome=ConfigDict(dict(kind="rule", base_url="", model="", api_key_env="OPENAI_API_KEY", votes=1)),
        process=ConfigDict(dict(kind="rule", base_url="", model="", api_key_env="OPENAI_API_KEY", votes=1)),
        cache_dir="", partial_f1=0.0))
    # Devices. mesh: the trainer's (data, fsdp, tensor) axis sizes, -1 for the devices left over;
    # all 1 (the default) is one device, no mesh. mesh.sampler: the same over each process's own
    # devices, where it samples with a full copy of the parameters (all 1: its first device).
    c.mesh = ConfigDict(dict(data=1, fsdp=1, tensor=1, sampler=ConfigDict(dict(data=1, fsdp=1, tensor=1))))
    # Several processes (TPU pods, GPU hosts): mode off | auto | on; empty fields come from
    # JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID or JAX's cluster detection.
    c.distributed = ConfigDict(dict(mode="auto", coordinator_address="", num_processes=0, process_id=-1,
                                    initialization_timeout_s=300, heartbeat_timeout_s=100, shutdown_timeout_s=300))
    # Low-rank adapters (models/lora.py) for every training job: rank 0 trains every weight.
    # export_adapters: each exported policy also holds its adapters in PEFT's format (adapters/).
    c.lora = ConfigDict(dict(rank=0, alpha=32.0, targets=("q", "k", "v", "o", "gate", "up", "down"),
                             export_adapters=False))
    c.progress = True
    return c
