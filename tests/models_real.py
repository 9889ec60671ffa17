"""Real checkpoints shared by the model tests: loaded once per pytest process (test helper)."""
import functools

from steprl_jax.models import load_pretrained


@functools.lru_cache(maxsize=None)
def smollm2():
    """(model, tokenizer) of the smollm2-135m-instruct preset, float32. Do not mutate; copy first."""
    return load_pretrained("smollm2-135m-instruct")


def smollm2_tokenizer():
    return smollm2()[1]


@functools.lru_cache(maxsize=None)
def transformers_smollm2():
    """transformers' SmolLM2-135M-Instruct from the same GGUF file, float32, eval mode (the reference;
    ~27 s to load and dequantize, so once per process). Runs on one torch thread: torch's spinning
    worker threads crawl on a shared, oversubscribed CPU."""
    import os

    import torch
    import transformers

    from steprl_jax.models.pretrained import resolve_source

    torch.set_num_threads(1)
    folder, name = os.path.split(resolve_source("smollm2-135m-instruct"))
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
