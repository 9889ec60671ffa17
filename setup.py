from setuptools import find_packages, setup

setup(
    name="steprl_jax",
    version="0.1.0",
    description="Step-wise RL (SWiRL, PORTool, GRPO, DAPO, ARPO) for tool-using LLM agents in JAX/Flax",
    python_requires=">=3.10",
    packages=find_packages(include=["steprl_jax", "steprl_jax.*"]),
    # Every third-party module steprl_jax imports at run time (no comments inside this list: CI's check
    # reads it as text). jinja2: transformers' apply_chat_template needs it but lists it only in an
    # extra. tensorboardX: training runs write TensorBoard event files. Every range is closed above at
    # the next major (or minor, before 1.0) series than the one CI installs and tests
    # (tests/test_versions.py checks the installed versions against these ranges).
    install_requires=[
        "jax>=0.7,<0.11",
        "flax>=0.12,<0.13",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "tensorstore>=0.1.70,<0.2",
        "ml-collections>=1.0,<2",
        "absl-py>=1.4,<3",
        "transformers>=4.56,<6",
        "jinja2>=3.1,<4",
        "tokenizers>=0.21,<1",
        "safetensors>=0.5,<1",
        "gguf>=0.17,<1",
        "numpy>=1.26,<3",
        "ml-dtypes>=0.4,<1",
        "jsonschema>=4.20,<5",
        "bm25s>=0.2.10,<0.4",
        "tqdm>=4.66,<5",
        "matplotlib>=3.8,<4",
        "tensorboardX>=2.6,<3",
        "math-verify>=0.9,<1",  # ToRL's answer check (judges/rules.py math_verify_outcome)
    ],
    extras_require={
        "test": ["pytest>=8,<10", "hypothesis>=6.100,<7", "torch==2.13.0", "accelerate>=1.0,<2", "openai>=1.40,<4",
                 "peft>=0.13,<1", "pytest-xdist>=3.8,<4", "jax[tpu]>=0.7,<0.11", "import-linter>=2.17,<3"],
        "tpu": ["jax[tpu]>=0.7,<0.11"],
        "gpu": ["jax[cuda12]>=0.7,<0.11"],
        "bench": ["torch==2.13.0", "trl>=1.16,<2"],
    },
)
