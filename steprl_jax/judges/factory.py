"""Build a judge from a config mapping.

    judge = build_judge({"kind": "http", "base_url": "http://127.0.0.1:8000/v1", "model": "m",
                         "api_key_env": "OPENAI_API_KEY", "votes": 5, "cache_dir": "runs/judge_cache"},
                        role="trajectory")
    verdicts = judge.judge(items)

role: "process" (GOOD/BAD, SWiRL filtering and step reward), "outcome" (YES/NO against the answer
key) or "trajectory" (PORTool's true / false / unable_to_answer).
kind: "rule" (rules.py; `rule` names the answer check: gsm8k | hotpotqa | toolworld | math_verify),
"local" (our sampler: `model` is a load_pretrained source, or pass `local_model=(model, tokenizer)`),
"http" (an OpenAI-compatible endpoint). Keys that do not apply to the kind are ignored; unknown keys are errors,
so that a typo is not silently a default.
"""
from __future__ import annotations

from typing import Any, Mapping

from steprl_jax.judges.backends import CachedBackend, ChatBackend
from steprl_jax.judges.cache import ReplyCache
from steprl_jax.judges.model_judges import ModelJudge, OutcomeJudge, ProcessJudge, TrajectoryVerdictJudge
from steprl_jax.judges.rule_judges import RuleOutcomeJudge, RuleProcessJudge, RuleTrajectoryJudge

ROLES = ("process", "outcome", "trajectory")
KINDS = ("rule", "local", "http")
_MODEL_JUDGES: dict[str, type[ModelJudge]] = {
    "process": ProcessJudge, "outcome": OutcomeJudge, "trajectory": TrajectoryVerdictJudge}
_JUDGE_KEYS = ("votes", "temperature", "max_tokens", "max_workers", "max_context_chars")
_HTTP_KEYS = ("base_url", "model", "api_key_env", "timeout_s", "retries", "backoff_s", "max_backoff_s",
              "max_concurrency", "max_n_per_request", "extra_body")
_LOCAL_KEYS = ("model", "compute_dtype", "max_context", "seed")
_RULE_KEYS = ("rule", "partial_f1", "rel_tol")
KNOWN_KEYS = frozenset(("kind", "cache_dir") + _JUDGE_KEYS + _HTTP_KEYS + _LOCAL_KEYS + _RULE_KEYS)


def _plain(config: Any) -> dict:
    return dict(config.to_dict() if hasattr(config, "to_dict") else config)


def _pick(config: dict, keys: tuple[str, ...]) -> dict:
    # Empty strings and None mean "not set" (config files list every key for every kind).
    return {k: config[k] for k in keys if k in config and config[k] is not None and config[k] != ""}


def _checked(config: Any) -> dict:
    config = _plain(config)
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        raise ValueError(f"unknown judge config key(s) {unknown}; known: {sorted(KNOWN_KEYS)}")
    kind = config.get("kind", "rule")
    if kind not in KINDS:
        raise ValueError(f"judge kind must be one of {KINDS}, got {kind!r}")
    return config


def build_backend(config: Mapping[str, Any], *, cache_dir: str | None = None, local_model=None) -> ChatBackend:
    """The chat backend of a model judge config (kind "http" or "local"), behind the reply cache when
    `cache_dir` (argument or config key) is set."""
    config = _checked(config)
    kind = config.get("kind", "rule")
    if kind == "rule":
        raise ValueError("a rule judge has no chat backend")
    backend = _http_backend(config) if kind == "http" else _local_backend(config, local_model)
    cache_dir = cache_dir or config.get("cache_dir")
    return CachedBackend(backend, ReplyCache(cache_dir)) if cache_dir else backend


def build_judge(config: Mapping[str, Any], role: str, *, rule: str | None = None, local_model=None,
                cache_dir: str | None = None):
    """A judge for `role` from `config` (a dict or ConfigDict). See the module docstring."""
    config = _checked(config)
    if role not in ROLES:
        raise ValueError(f"judge role must be one of {ROLES}, got {role!r}")
    if config.get("kind", "rule") == "rule":
        return _rule_judge(config, role, rule)
    backend = build_backend(config, cache_dir=cache_dir, local_model=local_model)
    return _MODEL_JUDGES[role](backend, **_pick(config, _JUDGE_KEYS))


def _rule_judge(config: dict, role: str, rule: str | None):
    if role == "process":
        return RuleProcessJudge()
    settings = _pick(config, _RULE_KEYS)
    settings["rule"] = settings.get("rule", rule)
    if settings["rule"] is None:
        raise ValueError(f"a rule {role} judge needs `rule` (gsm8k | hotpotqa | toolworld | math_verify)")
    if not settings.get("partial_f1"):  # 0.0 means off, not "any overlap counts"
        settings["partial_f1"] = None
    return (RuleOutcomeJudge if role == "outcome" else RuleTrajectoryJudge)(**settings)


def _http_backend(config: dict):
    from steprl_jax.judges.http_backend import HttpChatBackend

    settings = _pick(config, _HTTP_KEYS)
    if "base_url" not in settings or "model" not in settings:
        raise ValueError("an http judge needs `base_url` (e.g. http://127.0.0.1:8000/v1) and `model`")
    return HttpChatBackend(**settings)


def _local_backend(config: dict, local_model):
    settings = _pick(config, _LOCAL_KEYS)
    if local_model is None:
        if "model" not in settings:
            raise ValueError("a local judge needs `model` (a load_pretrained source) or local_model=(model, tokenizer)")
        from steprl_jax.models.pretrained import load_pretrained

        local_model = load_pretrained(settings["model"], compute_dtype=settings.get("compute_dtype"))
    from steprl_jax.judges.local_backend import LocalChatBackend

    model, tokenizer = local_model
    return LocalChatBackend(model, tokenizer, **{k: v for k, v in settings.items() if k in ("max_context", "seed")})
