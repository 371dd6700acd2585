"""Where the harness sends requests: an engine in this process, or an OpenAI-compatible endpoint.

Both arms of a run (baseline and candidate) are :class:`Target` objects with the same calls:
generate one completion with per-token log-probabilities, and force cache states through the
admin operations (drop everything; drop the window snapshots; wait for write-back). A target
reports what each request did (path, cached and replayed tokens, prefill work) when the engine
says so; an endpoint that is not replaykv reports no path and the "state_reached" metric is
then unknown rather than wrong.

Log-probabilities are keyed by the token's printable name (replaykv's names are unique; the
OpenAI wire format keys top log-probabilities by name), so in-process and endpoint runs compute
the same divergences.

Not for: deciding what to send (see :mod:`replaykv.accept.run`).
"""

from __future__ import annotations

import abc
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from replaykv.accept.cases import STOP_IDS
from replaykv.images import PromptImage


class TargetError(RuntimeError):
    """A target cannot do what the harness needs (the message says what and how to fix it)."""


@dataclass
class Observation:
    """One finished request."""

    ids: list[int]
    chosen: list[float]  # logprob of each generated token
    top: list[dict[str, float]]  # per generated token: the k most likely tokens' logprobs
    path: str | None = None
    cached_tokens: int | None = None
    replayed_tokens: int | None = None
    prefill_work: int | None = None
    full_prefill_work: int | None = None
    snapshot_hit: bool | None = None
    ttft_s: float = 0.0
    latency_s: float = 0.0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. image_tokens, images_encoded


class Target(abc.ABC):
    """One arm: an engine with fixed replay switches."""

    name: str

    @abc.abstractmethod
    def generate(self, prompt: tuple[int, ...], max_tokens: int, ignore_eos: bool, temperature: float,
                 seed: int, logprobs: int, images: tuple[PromptImage, ...] = ()) -> Observation:  # fmt: skip
        """Greedy (temperature 0) or seeded sampling of one completion of token ids `prompt`
        whose image spans are `images`."""

    @abc.abstractmethod
    def flush_all(self) -> None:
        """Drop every cached state (device pool, SWA pool, store)."""

    @abc.abstractmethod
    def flush_pool(self) -> None:
        """Drop every window snapshot (write-back drained first)."""

    @abc.abstractmethod
    def flush_writeback(self) -> None:
        """Wait until finished requests' write-back is done."""

    @abc.abstractmethod
    def cache_stats(self) -> dict[str, Any]:
        """The engine's per-ledger statistics ({} when it has none)."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """What this arm is (model, switches, where), for the report."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the target started."""


class InProcessTarget(Target):
    """An :class:`~replaykv.engine.engine.Engine` built from an EngineConfig in this process."""

    def __init__(self, name: str, config: Any) -> None:
        from replaykv.engine.engine import Engine

        self.name = name
        self.config = config
        self.engine = Engine(config)

    def generate(self, prompt: tuple[int, ...], max_tokens: int, ignore_eos: bool, temperature: float,
                 seed: int, logprobs: int, images: tuple[PromptImage, ...] = ()) -> Observation:  # fmt: skip
        from replaykv.engine.api import EngineError, Request, SamplingParams

        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop_token_ids=() if ignore_eos else STOP_IDS,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
        )
        try:
            res = self.engine.generate(Request(prompt, sampling, images=images))
        except EngineError as e:
            return Observation([], [], [], error=str(e))
        name = self.engine.tokenizer.token_text
        acc = res.accounting
        obs = Observation(
            ids=list(res.token_ids),
            chosen=[lp.logprob for lp in res.logprobs],
            top=[{name(i): v for i, v in lp.top} for lp in res.logprobs],
            ttft_s=res.ttft_s,
            latency_s=res.latency_s,
        )
        if acc is not None:
            obs.path, obs.cached_tokens, obs.replayed_tokens = (
                acc.path,
                acc.cached_tokens,
                acc.replayed_tokens,
            )
            obs.prefill_work, obs.full_prefill_work = acc.prefill_work, acc.full_prefill_work
            obs.snapshot_hit = acc.snapshot_hit
            if images:
                obs.extra = {"image_tokens": acc.image_tokens, "images_encoded": acc.images_encoded}
        return obs

    def flush_all(self) -> None:
        self.engine.flush_all()

    def flush_pool(self) -> None:
        self.engine.flush_swa_pool()

    def flush_writeback(self) -> None:
        self.engine.flush_writeback()

    def cache_stats(self) -> dict[str, Any]:
        return self.engine.cache_stats()

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "mode": "in-process",
            **self.engine.model_identity,
            "encoder_replay": c.enable_encoder_swa_bounded_replay,
            "decoder_replay": c.enable_decoder_swa_bounded_replay,
            "swa_miss_strategy": c.swa_miss_strategy,
            "fault": c.fault,
            "device": c.device,
            "dtype": c.dtype,
        }

    def close(self) -> None:
        self.engine.shutdown()


class EndpointTarget(Target):
    """An OpenAI-compatible server: completions with token-id prompts, streamed (for TTFT), with
    ``logprobs``; replaykv's admin endpoints force the cache states."""

    def __init__(self, name: str, url: str, api_key: str = "none", admin_key: str | None = None,
                 model: str | None = None, timeout_s: float = 600.0) -> None:  # fmt: skip
        try:
            import openai
        except ImportError as e:
            raise TargetError("endpoint mode needs the openai client: pip install 'replaykv[accept]'") from e

        self.name = name
        self.url = url.rstrip("/")
        base = self.url if self.url.endswith("/v1") else f"{self.url}/v1"
        self.root = base[: -len("/v1")]
        self.client = openai.OpenAI(base_url=base, api_key=api_key, max_retries=0, timeout=timeout_s)
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.timeout_s = timeout_s
        try:
            served = self.client.models.list().data
        except Exception as e:
            raise TargetError(f"{name}: cannot list models at {base}: {e}") from e
        if not served:
            raise TargetError(f"{name}: {base}/models lists no model")
        self.model = model or served[0].id
        card = next((m for m in served if m.id == self.model), served[0])
        extra = getattr(card, "model_extra", None) or {}
        # what a replaykv server says its weights and config are (other engines: absent)
        self.identity = {k: extra[k] for k in ("weights_sha256", "config_digest") if k in extra}

    def _admin(self, method: str, path: str) -> dict[str, Any]:
        req = urllib.request.Request(self.root + path, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                out: dict[str, Any] = json.loads(r.read())
                return out
        except urllib.error.HTTPError as e:
            if e.code in (401, 403, 404):
                raise TargetError(
                    f"{self.name}: {path} answered {e.code}: forcing cache states needs the server's admin "
                    "endpoints (start it with --admin-key and pass the same key to the harness)"
                ) from e
            raise TargetError(f"{self.name}: {path} answered {e.code}: {e.read()[:200]!r}") from e

    def generate(self, prompt: tuple[int, ...], max_tokens: int, ignore_eos: bool, temperature: float,
                 seed: int, logprobs: int, images: tuple[PromptImage, ...] = ()) -> Observation:  # fmt: skip
        if images:
            raise TargetError(
                f"{self.name}: a token-id completion carries no images; run image cases in process"
            )
        extra: dict[str, Any] = {"return_token_ids": True, "ignore_eos": ignore_eos}
        if not ignore_eos:
            extra["stop_token_ids"] = list(STOP_IDS)
        t0 = time.perf_counter()
        ttft = None
        ids: list[int] = []
        chosen: list[float] = []
        top: list[dict[str, float]] = []
        usage: dict[str, Any] = {}
        try:
            stream = self.client.completions.create(
                model=self.model,
                prompt=list(prompt),
                max_tokens=max_tokens,
                temperature=temperature,
                seed=seed,
                logprobs=logprobs,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.model_dump()
                if not chunk.choices:
                    continue
                ch = chunk.choices[0]
                got = (ch.model_extra or {}).get("token_ids") or []
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += got
                if ch.logprobs is not None:
                    chosen += [float(v) for v in ch.logprobs.token_logprobs or []]
                    top += [dict(d) for d in ch.logprobs.top_logprobs or []]
        except Exception as e:
            return Observation([], [], [], error=f"{type(e).__name__}: {e}")
        obs = Observation(ids, chosen, top, ttft_s=ttft or 0.0, latency_s=time.perf_counter() - t0)
        rk = usage.get("replaykv") or {}
        if rk:
            obs.path, obs.cached_tokens, obs.replayed_tokens = (
                rk["path"],
                rk["cached_tokens"],
                rk["replayed_tokens"],
            )
            obs.prefill_work, obs.full_prefill_work = rk["prefill_work"], rk["full_prefill_work"]
            obs.snapshot_hit = rk["snapshot_hit"]
        return obs

    def flush_all(self) -> None:
        self._admin("POST", "/admin/flush_all")

    def flush_pool(self) -> None:
        self._admin("POST", "/admin/flush_swa_pool")

    def flush_writeback(self) -> None:
        self._admin("POST", "/admin/flush_writeback")

    def cache_stats(self) -> dict[str, Any]:
        return self._admin("GET", "/admin/cache_stats")

    def describe(self) -> dict[str, Any]:
        return {"mode": "endpoint", "url": self.url, "model": self.model, **self.identity}

    def close(self) -> None:
        self.client.close()
