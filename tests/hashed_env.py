"""A tiny random policy and a tool-call environment for it: a random model writes no tool calls, so the
kind of each action is read off a hash of its text (a calculator call for half of them, an answer,
or an invalid action). Rollout schedules then meet tool-call steps, answers, invalid steps and
chains that end early."""
import zlib

from steprl_jax.agents.environments import ActionOutcome, TaggedEnv
from steprl_jax.tools.protocol import ToolCall


class HashedActionEnv(TaggedEnv):
    """The kind of an action is its text's CRC-32 mod 4: 0, 1 a calculator call; 2 an answer; 3 invalid."""

    def parse(self, action_text):
        return ("math", "math", "answer", "invalid")[zlib.crc32(action_text.encode()) % 4]

    def calls_for(self, kind):
        return [ToolCall("calculator", {"expression": "2 + 3"})] if kind == "math" else []

    def outcome(self, task, kind, results):
        if kind == "answer":
            return ActionOutcome("answer", [], [], "", "5", [], {})
        if kind == "math":
            return ActionOutcome("math", self.calls_for(kind), list(results), "\n2 + 3 -> 5\n", None, [], {})
        return ActionOutcome("invalid", [], [], "\nError: no action found.\n", None, ["no_action"], {})



def tiny_random_policy(seed: int = 7, embed_scale: float = 1.0):
    """(model, tokenizer, sampler): a tiny random llama with the SmolLM2 tokenizer; `embed_scale`
    sharpens its (tied) logits."""
    from flax import nnx

    from steprl_jax.models import ModelConfig, Transformer
    from steprl_jax.sampling import Sampler
    from swirl_helpers import smol_tokenizer

    tokenizer = smol_tokenizer()
    config = ModelConfig.tiny("llama", vocab_size=len(tokenizer), max_position_embeddings=2048,
                              eos_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    model = Transformer(config, rngs=nnx.Rngs(seed))
    if embed_scale != 1.0:
        model.embed.set_value(model.embed.get_value() * embed_scale)
    return model, tokenizer, Sampler(model, tokenizer, max_context=2048)
