"""The online RL section (config.job = "rl"): shared loop settings and one block per method.

Defaults follow the PORTool paper where they fit (n = 8 trajectories per query, f = 2,
gamma = 0.95, w1 = w2 = 1, clip 0.2, no KL) and the baselines' papers (DAPO clip-higher 0.28,
token-level loss; GRPO seq-mean-token-mean, verl's sample std).
"""
from ml_collections import ConfigDict

ATTENTION_LENGTH = 3072.0
MAX_MICROBATCH_TOKENS = 2048


def rl_config() -> ConfigDict:
    return ConfigDict(dict(
        iterations=20, queries_per_iteration=4, ppo_epochs=1, minibatches=1, num_microbatches=1,
        # Padded tokens per micro-batch and data shard: a batch runs as more micro-batches when
        # it holds more (the same gradient; activations and attention scores follow the
        # micro-batch). 2048 is the fastest on CPU (cache-sized micro-batches: the benchmark's
        # GRPO batch of 64 x 192 trains 1.2-1.3x faster as 8 micro-batches than as one) and keeps
        # a SmolLM2-135M step around 1 GiB of temporaries; raise it on accelerators, where
        # larger micro-batches fill the chip. 0: exactly num_microbatches.
        max_microbatch_tokens=MAX_MICROBATCH_TOKENS,
        save_every=1, eval_every=5, max_row_tokens=8192,
        # A minibatch whose trained tokens all have advantage 0 (every group's rewards equal)
        # takes no optimizer step: its gradient is 0, but AdamW's momentum and weight decay would
        # still move the policy. Only without a KL or entropy term (they give a gradient anyway).
        skip_update_without_signal=True,
        # Rows are regrouped to the layout of least estimated cost, padded tokens x (1 + keys /
        # attention_length): keys are what a query attends over (a packed tree row's longest
        # path, with gathered key blocks), attention_length the keys at which a token's attention
        # costs as much as the rest of its forward and backward (measured for SmolLM2-135M on
        # CPU; larger with fused attention kernels). 0 keeps the rows as the algorithm built them.
        attention_length=ATTENTION_LENGTH,
        # shared by PORTool's R_fm cap and the *_fm baselines
        gamma=0.95, fm_scale=0.25,
        eval=ConfigDict(dict(num_tasks=32, episodes_per_task=1, temperature=0.0, votes=5)),
        # Asynchronous rollouts (algorithms/async_loop.py): a rollout thread samples iterations
        # ahead of the learner, at most `max_staleness` policy versions behind it (0: the
        # synchronous loop). in_flight: each new version goes to the sampler at once, also inside
        # an episode (fresher data, timing-dependent runs); otherwise iteration i samples with
        # version i - max_staleness exactly (deterministic, resumes bit for bit). is_cap: the
        # off-policy correction's cap on min(pi_prox / pi_behaviour, cap) (verl's and Tunix's
        # default 2); 0 trains on the sampler's log-probs uncorrected.
        # (Not "async": a Python keyword, which ml_collections' --config.* flags cannot parse.)
        asynchronous=ConfigDict(dict(max_staleness=0, in_flight=False, is_cap=2.0)),
        # SFT on the tool world's expert demonstrations before RL; `source`: an exported policy
        # to start from instead (e.g. the warm start of another run), skipping it.
        # save_every: a checkpoint every that many updates, so that a run killed during its warm
        # start resumes there (SmolLM2-135M on 2 cores: 70-90 s an update, 40 updates).
        warm_start=ConfigDict(dict(source="", updates=0, batch_size=8, learning_rate=1e-5, num_microbatches=1,
                                   max_microbatch_tokens=MAX_MICROBATCH_TOKENS,
                                   max_row_tokens=4096, save_every=10)),
        # discount_failures: gamma**(T - t) multiplies every outcome, as the paper writes it; False
        # discounts successes only (a discounted -1 pays a wrong answer for coming later).
        portool=ConfigDict(dict(w1=1.0, w2=1.0, rescale_fork_weight=True, ddof=0, discount_failures=True,
                                eps_low=0.2, eps_high=0.2, agg="query_token_mean",
                                token_weighting="per_trajectory")),
        grpo=ConfigDict(dict(eps_low=0.2, eps_high=0.2, kl_coef=0.0, agg="seq_mean_token_mean", ddof=1)),
        # overlong shaping: L_cache = overlong_cache; L_max = max_response_tokens, 0: where the
        # context truncates, rollout.max_context minus the prompt (L counts actions and tool
        # responses; a trajectory cut by the context or ending in an action cut at
        # rollout.max_new_tokens gets -1; algorithms/dapo.py)
        dapo=ConfigDict(dict(eps_low=0.2, eps_high=0.28, agg="token_mean", ddof=1, overlong_cache=64,
                             max_response_tokens=0, max_sampling_rounds=3)),
        arpo=ConfigDict(dict(initial=4, alpha=0.5, beta=0.5, entropy_tokens=20)),
        # GiGPO (verl-agent's search-QA runs): A = A_episode + step_weight * A_step, discounted step
        # returns, anchor states by the last observation, torch.std, invalid actions penalised.
        gigpo=ConfigDict(dict(eps_low=0.2, eps_high=0.2, kl_coef=0.0, agg="token_mean", ddof=1, gamma=0.95,
                              step_weight=1.0, mode="mean_std_norm", episode_stats="steps",
                              state_key="observation", invalid_penalty=0.01)),
        # Tree-GRPO (AMAP-ML/Tree-GRPO's scripts): m trees per query, `rounds` rounds of n expansions
        # per tree, `keep` leaves kept per tree (m * keep trajectories per query).
        tree_grpo=ConfigDict(dict(eps_low=0.2, eps_high=0.2, kl_coef=0.0, agg="token_mean", ddof=1, m=2, n=2,
                                  rounds=1, keep=3, combine="sum")),
        # ToRL (GAIR-NLP/ToRL's torl_1.5b.sh): GRPO, symmetric clip 0.2, no KL, verl's token mean,
        # torch.std; runs the code format (configs/torl_arithmetic.py).
        torl=ConfigDict(dict(eps_low=0.2, eps_high=0.2, agg="token_mean", ddof=1)),
        # SimpleTIR (ltzheng/SimpleTIR's train.sh and README): GRPO with reward 1/0, clip 0.2/0.28 and
        # dual clip 3, no KL, token mean; void-turn trajectories masked; groups with reward std <
        # min_std or every response truncated dropped and re-sampled; code_turns format
        # (configs/simpletir_arithmetic.py).
        simpletir=ConfigDict(dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0, agg="token_mean", ddof=1,
                                  mask_void_turns=True, min_std=1e-3, max_sampling_rounds=3)),
        # Flow-GRPO (AgentFlow's train/config.yaml): planner turns 3, clip 0.2 / 0.3, KL loss 0.001 to
        # the initial policy, torch.std; normalize "rollout" (the paper, Agent Lightning 1.0) or "row"
        # (AgentFlow's published code). The frozen modules: "base" (model.source as loaded, before
        # any warm start of the planner) or "http" (an OpenAI-compatible endpoint); memory_chars: how much of a command or result the memory
        # shows. Runs the flow format (configs/flow_grpo_arithmetic.py).
        flow_grpo=ConfigDict(dict(
            max_turns=3, normalize="rollout", eps_low=0.2, eps_high=0.3, kl_coef=0.001, ddof=1, memory_chars=400,
            tools=("Python_Coder_Tool", "Base_Generator_Tool"),
            frozen=ConfigDict(dict(kind="base", base_url="", model="", api_key_env="", timeout_s=60.0,
                                   temperature=0.0, max_tokens=256)))),
    ))
