"""Real checkpoints shared by the model tests: loaded once per pytest process (test helper)."""
import functools

from steprl_jax.models import load_pretrained


@functools.lru_cache(maxsize=None)
def smollm2():
    """(model, tokenizer) of the smollm2-135m-instruct preset, float32. Do not mutate; copy first."""
    return load_pretrained("smollm2-135m-instruct")


def smollm2_tokenizer():
    return smollm2()[1]
