"""A small OpenAI-compatible server for any model `load_pretrained` accepts, through our sampler.

    python -m steprl_jax.serve --model smollm2-135m-instruct --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}]}'
"""
from steprl_jax.serve.app import ChatServer, ServerLimits, chat_completion
from steprl_jax.serve.chat_format import RequestError, parse_tool_calls, render_prompt
from steprl_jax.serve.engine import ChatEngine, Completion, Delta, Job

__all__ = ["ChatEngine", "ChatServer", "Completion", "Delta", "Job", "RequestError", "ServerLimits",
           "chat_completion", "parse_tool_calls", "render_prompt"]
