"""The serving engine: one background thread that owns the model and batches requests continuously.

Threading. ``submit`` (any thread) validates a request and appends it to a bounded waiting queue;
the engine thread is the only one that touches the model and the batched cache view. It loops
over steps; each step (1) drops cancelled requests, (2) admits waiting requests into free rows
(cache lookup, load of the hit into the row, ``plan_prefill``), (3) runs prefill work under
``prefill_token_budget`` rows, (4) runs one batched decode forward for every request whose
prefill is done. Results travel back through :class:`EngineHandle` (a list of deltas behind a
condition variable, woken for asyncio consumers with ``loop.call_soon_threadsafe``).

Rows. The cache view has ``max_batch`` rows of ``max_context`` tokens. Decoding requests always
occupy rows ``[0, n_decode)`` so one decode forward runs on the contiguous slice ``[0, n_decode)``
(rows at different positions; rows being prefilled or free are never touched by it). Region map::

    [0, n_decode)          decoding rows, compact
    [n_decode, max_batch)  rows being prefilled (each on its own single-row view) and free rows

A request whose prefill ends moves to row ``n_decode`` (swapping rows when another prefill sits
there); a finishing decode row is filled by the last decode row. Moves copy the row's caches.

Chunked prefill. A plan's calls (its segments; bounded replay's replayed and new rows as one,
see ``PrefillPlan.calls``) run in order; a call is cut along its tokens into pieces of at most
the budget left in the step (a later piece of a layer range reads the window ring and
compressor carry the earlier piece left). A call starting above layer 0 (decoder replay) takes
its input rows from the outputs kept from earlier pieces, so only the rows a later call (or the
logits row) needs are kept. The prefill of a request: lookup -> load -> plan -> pieces ->
logits of the last prompt row -> first token; the row's state is committed (background
write-back) at the end of the prefill and at the end of the generation.

Not for: HTTP (``replaykv.server``), the cache ledgers (``replaykv.cache``), plans
(``replaykv.replay``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client.metrics_core import Metric

from replaykv.cache.device_pool import DevicePool
from replaykv.cache.faultlog import FaultLog
from replaykv.cache.features import FeatureCache
from replaykv.cache.layout import CacheLayout
from replaykv.cache.manager import CacheManager
from replaykv.cache.store import LocalStore
from replaykv.cache.stores import make_store
from replaykv.cache.swa_pool import make_swa_pool
from replaykv.cache.views import allocate_view
from replaykv.engine.api import (
    Accounting,
    Delta,
    EngineAPI,
    EngineError,
    InvalidRequest,
    QueueFull,
    Request,
    RequestHandle,
    Result,
    SamplingParams,
    TokenLogprob,
)
from replaykv.engine.config import EngineConfig
from replaykv.engine.metrics import EngineCounters, engine_families
from replaykv.engine.runner import _gather, _Piece
from replaykv.engine.sampling import OutputStream, Sampler, check_sampling, token_logprob
from replaykv.engine.scenario import inject_fault
from replaykv.images import ImageError, check_placement
from replaykv.model.cache_view import CacheView, CompressorCarry, LayerCacheView
from replaykv.model.checkpoint import weights_digest
from replaykv.model.spec import ModelSpec
from replaykv.model.step import Residual, Selection
from replaykv.replay import (
    CacheState,
    PrefillPlan,
    ReplayFlags,
    ReplayOptionError,
    check_request_options,
    plan_prefill,
)
from replaykv.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["Engine", "EngineHandle", "generate"]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
# Handles
# ------------------------------------------------------------------------------------------------


class EngineHandle(RequestHandle):
    """A submitted request. Every consumer (sync iterator, async iterator, ``result``) sees every
    delta from the first; the engine thread appends them."""

    def __init__(self, engine: Engine, request: Request) -> None:
        self.request = request
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._engine = engine
        self._cond = threading.Condition()
        self._deltas: list[Delta] = []
        self._finished = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.cancel_requested = False

    # engine side
    def _put(self, delta: Delta) -> None:
        with self._cond:
            if self._finished:
                return
            self._deltas.append(delta)
            if delta.finished:
                self._finished = True
                self.finished_at = time.monotonic()
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # the consumer's loop may be closed
                loop.call_soon_threadsafe(_wake, fut)

    @property
    def finished(self) -> bool:
        return self._finished

    # consumer side
    def __iter__(self) -> Iterator[Delta]:
        seen = 0
        while True:
            with self._cond:
                while seen >= len(self._deltas):
                    self._cond.wait()
                batch = self._deltas[seen:]
            seen += len(batch)
            for delta in batch:
                yield delta
                if delta.finished:
                    return

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Delta]:
        loop = asyncio.get_running_loop()
        seen = 0
        while True:
            fut: asyncio.Future[None] | None = None
            with self._cond:
                batch = self._deltas[seen:]
                if not batch:
                    fut = loop.create_future()
                    self._waiters.append((loop, fut))
            if fut is not None:
                await fut
                continue
            seen += len(batch)
            for delta in batch:
                yield delta
                if delta.finished:
                    return

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the end. Raises TimeoutError, or EngineError when the request failed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._finished, timeout):
                raise TimeoutError(f"request {self.request.request_id!r} did not finish within {timeout} s")
            deltas = list(self._deltas)
        last = deltas[-1]
        if last.finish_reason == "error":
            raise EngineError(last.error or "the request failed")
        end = self.finished_at or time.monotonic()
        return Result(
            token_ids=[t for d in deltas for t in d.token_ids],
            text="".join(d.text for d in deltas),
            finish_reason=last.finish_reason or "stop",
            accounting=last.accounting,
            ttft_s=(self.first_token_at - self.submitted_at) if self.first_token_at is not None else 0.0,
            latency_s=end - self.submitted_at,
            logprobs=[lp for d in deltas for lp in d.logprobs],
        )

    def cancel(self) -> None:
        self.cancel_requested = True
        self._engine._wake()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# ------------------------------------------------------------------------------------------------
# Views and rows
# ------------------------------------------------------------------------------------------------


def _slice_view(view: CacheView, a: int, b: int) -> CacheView:
    """Rows [a, b) of every tensor (write-through); tensors shared by layers stay shared."""
    memo: dict[int, torch.Tensor] = {}

    def cut(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = t[a:b]
        return memo[id(t)]

    def cut_opt(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else cut(t)

    def carry(c: CompressorCarry | None) -> CompressorCarry | None:
        return None if c is None else CompressorCarry(cut(c.kv), cut(c.gate))

    layers = [
        LayerCacheView(
            cut(lv.window),
            cut_opt(lv.entries),
            carry(lv.carry),
            cut_opt(lv.index_keys),
            carry(lv.index_carry),
        )
        for lv in view.layers
    ]
    return CacheView(positions=view.positions[a:b], layers=layers)


def _row_tensors(view: CacheView) -> list[torch.Tensor]:
    """Every distinct tensor of the view with a row axis (positions included)."""
    out: dict[int, torch.Tensor] = {id(view.positions): view.positions}
    for lv in view.layers:
        for t in (lv.window, lv.entries, lv.index_keys):
            if t is not None:
                out.setdefault(id(t), t)
        for c in (lv.carry, lv.index_carry):
            if c is not None:
                out.setdefault(id(c.kv), c.kv)
                out.setdefault(id(c.gate), c.gate)
    return list(out.values())


def _key_parts(request: Request) -> tuple[tuple[int, int, bytes], ...]:
    """What prefix keys hash of a request's images."""
    return tuple(im.key_part for im in request.images)


def _build_model(config: EngineConfig) -> tuple[Any, str, ByteTokenizer | HFTokenizer]:
    from replaykv.model.checkpoint import build_model, cast_model, load_config, load_model, parse_dtype, place
    from replaykv.model.init import init_weights
    from replaykv.model.presets import get_preset

    if config.model_dir is not None:
        model_config = load_config(config.model_dir, kv_quant=config.kv_quant)
        model = load_model(config.model_dir, device=config.device, dtype=config.dtype, config=model_config)
        name = config.model_name or Path(config.model_dir).name
        return model, name, load_tokenizer(config.model_dir)
    model_config = get_preset(config.preset)
    if config.kv_quant is not None:
        model_config = model_config.replace(kv_quant=config.kv_quant)
    model = init_weights(build_model(model_config), seed=config.seed)
    cast_model(model, parse_dtype(config.dtype))
    model = place(model, config.device)
    return model, config.model_name or f"{config.preset}-random-seed{config.seed}", ByteTokenizer()


# ------------------------------------------------------------------------------------------------
# Request state
# ------------------------------------------------------------------------------------------------


@dataclass
class _Waiting:
    request: Request
    handle: EngineHandle
    flags: ReplayFlags


@dataclass
class _Active:
    """A request holding a row: prefilling (call cursor + kept pieces) or decoding."""

    request: Request
    handle: EngineHandle
    row: int
    tokens: list[int]
    ids: torch.Tensor  # [1, S] on the model's device
    plan: PrefillPlan
    accounting: Accounting
    sampler: Sampler
    output: OutputStream
    at_call: int = 0
    cursor: int = 0
    pieces: list[_Piece] = field(default_factory=list)
    spans: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> span vectors
    images_encoded: int = 0
    decoding: bool = False
    last_token: int = -1
    last_token_at: float = 0.0

    @property
    def prefill_done(self) -> bool:
        return self.at_call >= len(self.plan.calls)

    def skip_empty(self) -> None:
        calls = self.plan.calls
        while self.at_call < len(calls) and calls[self.at_call].tokens[1] <= calls[self.at_call].tokens[0]:
            self.at_call += 1
        if self.at_call < len(calls):
            self.cursor = calls[self.at_call].tokens[0]


# ------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------


class Engine(EngineAPI):
    """Continuous batching over one model with the replaykv cache ledgers (see the module doc)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config: EngineConfig = config
        self.model, self._model_name, self.tokenizer = _build_model(config)
        model_config = self.model.config
        self.spec = ModelSpec.from_config(model_config)
        if config.max_context > self.spec.max_position_embeddings:
            raise ValueError(
                f"max_context {config.max_context} exceeds the model's max_position_embeddings "
                f"{self.spec.max_position_embeddings}; lower it"
            )
        self.vocab_size = int(model_config.vocab_size)
        eos = model_config.eos_token_id
        self.eos_ids: tuple[int, ...] = (
            () if eos is None else tuple(eos) if isinstance(eos, tuple) else (eos,)
        )
        self.device = next(self.model.parameters()).device
        cache_dtype = self.model.model.embed_tokens.weight.dtype
        self.view = allocate_view(self.spec, config.max_batch, config.max_context, self.device, cache_dtype)
        self._row_views = [_slice_view(self.view, r, r + 1) for r in range(config.max_batch)]
        self._decode_views: dict[int, CacheView] = {}
        self._tensors = _row_tensors(self.view)
        self.cache = self._build_cache(cache_dtype) if config.caching else None
        self.vision = getattr(self.model.model, "vision", None)
        self.image_token_id = int(getattr(model_config, "image_token_id", -1))
        self.features: FeatureCache = FeatureCache(config.image_feature_cache_bytes, config.swa_pool_ttl_s)
        self.metrics: EngineCounters = EngineCounters()
        self._commit_faults = FaultLog(log, "cache commit")

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: deque[_Waiting] = deque()
        self._rows: list[_Active | None] = [None] * config.max_batch
        self._n_decode = 0
        self._prefilling: list[_Active] = []
        self._stopping = False
        self._closed = False
        self._fatal: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="replaykv-engine", daemon=True)
        self._thread.start()

    def _build_cache(self, cache_dtype: torch.dtype) -> CacheManager:
        cfg = self.config
        try:
            layout = CacheLayout(
                self.spec, cfg.chunk_size, kv_quant=bool(self.model.config.kv_quant), dtype=cache_dtype
            )
        except ValueError as exc:
            raise ValueError(f"chunk_size: {exc}") from exc
        self.weights_digest = weights_digest(self.model)
        namespace = layout.namespace(self.model.config.digest(), self.weights_digest)
        device_pool = DevicePool(layout, cfg.device_pool_bytes) if cfg.device_pool_bytes > 0 else None
        swa_pool = None
        if cfg.swa_pool == "memory":
            swa_pool = make_swa_pool(
                "memory", capacity_bytes=cfg.swa_pool_capacity_bytes, ttl_s=cfg.swa_pool_ttl_s
            )
        elif cfg.swa_pool == "redis":
            swa_pool = make_swa_pool(
                "redis", url=cfg.redis_url, ttl_s=cfg.swa_pool_ttl_s, cluster=cfg.redis_cluster
            )
        store = None
        if cfg.store_dir is not None:
            store = make_store(
                cfg.store_format,
                cfg.store_dir,
                cfg.store_capacity_bytes,
                retention_s=cfg.store_retention_s,
                shared=cfg.store_shared,
            )
        return CacheManager(
            self.spec,
            namespace,
            device_pool,
            swa_pool,
            store,
            chunk_size=cfg.chunk_size,
            write_policy=cfg.write_policy,
            queue_size=cfg.writeback_queue,
            layout=layout,
        )

    # ---------------------------------------------------------------- EngineAPI
    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def model_identity(self) -> dict[str, str]:
        """What a report names the served model by: its name, the sha256 of its weights (names,
        dtypes, shapes and bytes, as they sit in memory) and its config's digest."""
        return {
            "model": self._model_name,
            "weights_sha256": self.weights_digest,
            "config_digest": str(self.model.config.digest()),
        }

    @property
    def max_context(self) -> int:
        return self.config.max_context

    def submit(self, request: Request) -> EngineHandle:
        """Validate and queue ``request``; raises InvalidRequest or QueueFull, never blocks on the model."""
        try:
            flags = self._check(request)
        except InvalidRequest:
            self.metrics.rejected.inc("invalid")
            raise
        handle = EngineHandle(self, request)
        with self._lock:
            if self._closed or self._fatal is not None:
                raise EngineError(f"the engine is not running ({self._fatal or 'shut down'})")
            if len(self._waiting) >= self.config.max_queue:
                self.metrics.rejected.inc("queue_full")
                raise QueueFull(
                    f"{len(self._waiting)} requests are waiting (max_queue {self.config.max_queue}); retry later",
                    self._retry_after_locked(),
                )
            self._waiting.append(_Waiting(request, handle, flags))
            self._wakeup.notify()
        self.metrics.submitted.inc()
        return handle

    def _check(self, request: Request) -> ReplayFlags:
        prompt = request.prompt_ids
        if len(prompt) == 0:
            raise InvalidRequest("the prompt is empty; send at least one token")
        bad = [
            t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise InvalidRequest(f"token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")
        try:
            check_sampling(request.sampling, self.vocab_size)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        limit = self.config.max_context - request.sampling.max_tokens
        if len(prompt) > limit:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens but at most {max(limit, 0)} fit (max_context "
                f"{self.config.max_context} - max_tokens {request.sampling.max_tokens}); shorten it or lower max_tokens"
            )
        self._check_images(request)
        flags = request.replay if request.replay is not None else self.config.replay_flags
        try:
            return check_request_options(
                flags, prompt_logprobs=request.prompt_logprobs, fallback=request.full_path_fallback
            )
        except ReplayOptionError as exc:
            raise InvalidRequest(str(exc)) from exc

    def _check_images(self, request: Request) -> None:
        """Image spans inside the prompt, not overlapping, over image-token positions only."""
        if not request.images:
            return
        if self.vision is None:
            raise InvalidRequest(f"the model {self.model_name!r} has no vision tower; it reads text only")
        try:
            check_placement(request.prompt_ids, request.images, self.image_token_id)
        except ImageError as exc:
            raise InvalidRequest(str(exc)) from exc

    def _spans(self, r: _Active, t0: int, t1: int) -> list[tuple[int, torch.Tensor]]:
        """Span vectors of the request's images that rows [t0, t1) overlap: from the feature
        cache, else by running the tower (then kept in the cache)."""
        out = []
        for i, im in enumerate(r.request.images):
            if im.start >= t1 or im.end <= t0:
                continue
            vectors = r.spans.get(i)
            if vectors is None:
                vectors = self.features.get(im.image.digest)
                if vectors is None:
                    assert self.vision is not None
                    with torch.inference_mode():
                        vectors = self.vision.span(im.image)
                    self.features.put(im.image.digest, vectors)
                    r.images_encoded += 1
                    self.metrics.images_encoded.inc()
                r.spans[i] = vectors
            out.append((im.start, vectors))
        return out

    def _retry_after_locked(self) -> float:
        mean = self.metrics.e2e.as_dict()["mean"]
        per_request = float(mean) if isinstance(mean, float) else 1.0
        return min(60.0, max(0.1, per_request * len(self._waiting) / self.config.max_batch))

    def collect(self) -> Iterator[Metric]:
        return engine_families(self)

    def cache_stats(self) -> dict[str, Any]:
        features = {"image_features": self.features.as_dict()} if self.vision is not None else {}
        if self.cache is None:
            return {"caching": False, **features}
        return {"caching": True, **self.cache.stats(), **features}

    def flush_writeback(self) -> None:
        """Wait until every queued write-back job has finished (tests, benchmarks, shutdown)."""
        if self.cache is not None:
            self.cache.flush()

    def flush_swa_pool(self) -> None:
        if self.cache is not None and self.cache.swa_pool is not None:
            self.cache.flush()
            self.cache.swa_pool.flush()

    def flush_all(self) -> None:
        self.features.clear()
        cache = self.cache
        if cache is None:
            return
        cache.flush()
        if cache.device_pool is not None:
            cache.device_pool.evict_unreferenced()
        if cache.swa_pool is not None:
            cache.swa_pool.flush()
        if cache.store is not None and isinstance(cache.store, LocalStore):
            for key in cache.store.indexed_keys():
                cache.store.delete(key)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
            self._wakeup.notify_all()
        self._thread.join()
        if self.cache is not None:
            self.cache.close()
            close = getattr(self.cache.swa_pool, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- the engine thread
    def _wake(self) -> None:
        with self._lock:
            self._wakeup.notify()

    def _busy(self) -> bool:
        return any(r is not None for r in self._rows)

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._lock:
                        while not self._stopping and not self._waiting and not self._busy():
                            self._wakeup.wait()
                        if self._stopping:
                            break
                    self._step()
        except BaseException as exc:  # never leave callers waiting on a dead thread
            self._fatal = exc
            log.error(
                "the engine thread failed; every queued and running request ends with an error", exc_info=exc
            )
        finally:
            # Requests still queued or running end here: "error" after a crash, else "cancelled".
            finish = "error" if self._fatal else "cancelled"
            message = f"engine failed: {self._fatal!r}" if self._fatal else "the engine shut down"
            with self._lock:
                self._stopping = True
                waiting = list(self._waiting)
                self._waiting.clear()
            for w in waiting:
                w.handle._put(Delta(finished=True, finish_reason=finish, error=message))
            for r in [r for r in self._rows if r is not None]:
                r.handle._put(
                    Delta(finished=True, finish_reason=finish, accounting=r.accounting, error=message)
                )
            self._rows = [None] * self.config.max_batch

    def _step(self) -> None:
        self._reap_cancelled()
        self._admit()
        self._run_prefill()
        self._run_decode()

    def _reap_cancelled(self) -> None:
        with self._lock:
            gone = [w for w in self._waiting if w.handle.cancel_requested]
            for w in gone:
                self._waiting.remove(w)
        for w in gone:
            self._finish_handle(w.handle, Delta(finished=True, finish_reason="cancelled"))
        active = [r for r in self._rows if r is not None and r.handle.cancel_requested]
        for r in sorted(active, key=lambda r: -r.row):
            self._complete(r, "cancelled")

    def _admit(self) -> None:
        while True:
            row = next((i for i in range(self._n_decode, len(self._rows)) if self._rows[i] is None), None)
            if row is None:
                return
            with self._lock:
                if not self._waiting:
                    return
                w = self._waiting.popleft()
            if w.handle.cancel_requested:
                self._finish_handle(w.handle, Delta(finished=True, finish_reason="cancelled"))
                continue
            self.metrics.queue_wait.observe(time.monotonic() - w.handle.submitted_at)
            try:
                r = self._start(w, row)
            except Exception as exc:
                self._finish_handle(
                    w.handle,
                    Delta(finished=True, finish_reason="error", error=f"prefill setup failed: {exc!r}"),
                )
                continue
            self._rows[row] = r
            self._prefilling.append(r)
            if self.cache is not None and self.cache.device_pool is not None:
                self.cache.device_pool.reserve_window(id(r.handle))  # best effort: the view is preallocated

    def _start(self, w: _Waiting, row: int) -> _Active:
        """Look up and load the cached prefix into ``row`` and plan the prefill (the caller takes the row)."""
        tokens = list(w.request.prompt_ids)
        view = self._row_views[row]
        view.positions.zero_()
        view.window_floor = None
        hit, snapshot = 0, False
        reasons: tuple[str, ...] = ()
        if self.cache is not None:
            looked = self.cache.lookup(tokens, w.request.salt, images=_key_parts(w.request))
            loaded = self.cache.load(looked, view, 0) if looked.hit_tokens else looked
            hit, snapshot, reasons = loaded.hit_tokens, loaded.snapshot_at_hit, loaded.reasons
            if hit and not loaded.carry_at_hit:
                # The open group's compressor rows at `hit` are not cached: continue from the
                # last position that ends a group of every source (a bounded / truncate case).
                cut = hit
                while hit and self.cache.layout.needs_carry(hit):
                    hit -= 1
                snapshot = False
                reasons += (f"no compressor carry at {cut}: the hit is used up to {hit}",)
        state = CacheState(len(tokens), global_hit=hit, snapshot_at=(hit,) if snapshot and hit else ())
        plan = plan_prefill(state, self.spec, w.flags)
        if self.config.fault is not None:
            plan = self._inject_fault(plan, view)
        accounting = Accounting(
            path=plan.path,
            prompt_tokens=len(tokens),
            cached_tokens=plan.use_global,
            replayed_tokens=plan.replayed_tokens,
            prefill_work=plan.work,
            full_prefill_work=plan.full_work,
            window_floors=plan.window_floors,
            snapshot_hit=plan.restore_snapshot_at is not None,
            reasons=tuple(reasons) + plan.notes,
            image_tokens=sum(im.end - im.start for im in w.request.images),
        )
        sampling = w.request.sampling
        r = _Active(
            request=w.request,
            handle=w.handle,
            row=row,
            tokens=tokens,
            ids=torch.tensor([tokens], dtype=torch.long, device=self.device),
            plan=plan,
            accounting=accounting,
            sampler=Sampler(sampling, w.request.prompt_ids),
            output=OutputStream(sampling, self.tokenizer.decode, self.eos_ids),
        )
        r.skip_empty()
        m = self.metrics
        m.by_path.inc(plan.path)
        m.prompt_tokens.inc(len(tokens))
        m.cached_tokens.inc(accounting.cached_tokens)
        m.replayed_tokens.inc(accounting.replayed_tokens)
        m.prefill_work.inc(accounting.prefill_work)
        m.full_prefill_work.inc(accounting.full_prefill_work)
        if accounting.snapshot_hit:
            m.snapshot_hits.inc()
        return r

    def _inject_fault(self, plan: PrefillPlan, view: CacheView) -> PrefillPlan:
        """The configured deliberate fault (EngineConfig.fault), applied to one request's plan."""
        return inject_fault(self.config.fault, plan, view)

    # ---------------------------------------------------------------- prefill
    def _run_prefill(self) -> None:
        budget = self.config.prefill_token_budget
        t0 = time.perf_counter()
        for r in list(self._prefilling):
            if budget <= 0:
                break
            try:
                while budget > 0 and not r.prefill_done:
                    budget -= self._run_piece(r, budget)
                if r.prefill_done:
                    self._end_prefill(r)
            except Exception as exc:
                self._complete(r, "error", error=f"prefill failed: {exc!r}")
        if budget < self.config.prefill_token_budget:
            self.metrics.prefill_seconds += time.perf_counter() - t0

    def _run_piece(self, r: _Active, budget: int) -> int:
        """Run the next piece of the current call (at most ``budget`` rows); returns its rows."""
        call = r.plan.calls[r.at_call]
        t0 = r.cursor
        t1 = min(call.tokens[1], t0 + budget)
        a, b = call.layers
        view = self._row_views[r.row]
        if a == 0:
            spans = self._spans(r, t0, t1) if r.request.images else []
            state, selection = self.model.embed(r.ids[:, t0:t1], spans, t0), Selection()
        else:
            state, selection = _gather(r.pieces, a, t0, t1)
        view.positions.fill_(t0)
        view.window_floor = torch.full_like(view.positions, call.window_floor)
        step = self.model.step(view, t1 - t0, call.global_from < t1, max(0, call.global_from - t0))
        out = self.model.run_layers(state, range(a, b), step, view, selection)
        self._keep(r, b, t0, t1, out, selection)
        r.cursor = t1
        if t1 >= call.tokens[1]:
            r.at_call += 1
            r.skip_empty()
        self.metrics.prefill_tokens.inc(t1 - t0)
        return t1 - t0

    def _keep(self, r: _Active, layer: int, t0: int, t1: int, out: Residual, selection: Selection) -> None:
        """Keep the rows of a piece that a later call starting at ``layer`` (or the logits) reads."""
        s_len = r.plan.tokens
        need = [call.tokens for call in r.plan.calls[r.at_call + 1 :] if call.layers[0] == layer]
        if layer == len(self.spec.layers):
            need.append((s_len - 1, s_len))
        if not need:
            return
        lo = max(t0, min(n0 for n0, _ in need))
        hi = min(t1, max(n1 for _, n1 in need))
        if lo < hi:
            r.pieces.append(
                _Piece(layer, lo, hi, out.rows(lo - t0, hi - t0), selection.rows(lo - t0, hi - t0))
            )

    def _end_prefill(self, r: _Active) -> None:
        s_len = r.plan.tokens
        final, _ = _gather(r.pieces, len(self.spec.layers), s_len - 1, s_len)
        logits = self.model.head(final)[0, -1]
        r.pieces.clear()
        r.spans.clear()
        if r.images_encoded:
            r.accounting = dataclasses.replace(r.accounting, images_encoded=r.images_encoded)
        view = self._row_views[r.row]
        view.positions.fill_(s_len)
        view.window_floor = None
        self._commit(r, r.tokens)
        self._prefilling.remove(r)
        self.metrics.prefilled_prompt_tokens.inc(s_len)
        finish = self._accept(r, logits)
        if finish is not None:
            self._complete(r, *finish)
            return
        target = self._n_decode
        if r.row != target:
            other = self._rows[target]
            if other is None:
                self._move_row(r.row, target)
                self._rows[r.row] = None
            else:
                self._swap_rows(r.row, target)
                other.row, self._rows[r.row] = r.row, other
            r.row, self._rows[target] = target, r
        r.decoding = True
        self._n_decode += 1

    # ---------------------------------------------------------------- decode
    def _decode_view(self, n: int) -> CacheView:
        if n not in self._decode_views:
            self._decode_views[n] = _slice_view(self.view, 0, n)
        return self._decode_views[n]

    def _run_decode(self) -> None:
        n = self._n_decode
        if n == 0:
            return
        rows = [r for r in self._rows[:n] if r is not None]
        assert len(rows) == n and all(r.decoding for r in rows), "decode rows must be compact"
        t0 = time.perf_counter()
        threads = self.config.decode_threads if self.device.type == "cpu" else 0
        before = torch.get_num_threads()
        if threads and threads != before:
            torch.set_num_threads(threads)
        try:
            view = self._decode_view(n)
            ids = torch.tensor([[r.last_token] for r in rows], dtype=torch.long, device=self.device)
            logits = self.model(ids, view, logits_rows="last")[:, -1].float()
            view.positions += 1
            logits = logits.cpu()
        except Exception as exc:
            for r in reversed(rows):
                self._complete(r, "error", error=f"decode failed: {exc!r}")
            return
        finally:
            if threads and threads != before:
                torch.set_num_threads(before)
        self.metrics.decode_seconds += time.perf_counter() - t0
        self.metrics.decode_steps.inc()
        self.metrics.decode_tokens.inc(n)
        finishing: list[
            tuple[_Active, tuple[str, tuple[int, ...], str, tuple[TokenLogprob, ...]], str | None]
        ] = []
        for i, r in enumerate(rows):
            try:
                finish = self._accept(r, logits[i])
            except Exception as exc:  # e.g. non-finite logits under sampling: fail this request only
                finishing.append((r, ("error", (), "", ()), f"sampling failed: {exc!r}"))
                continue
            if finish is not None:
                finishing.append((r, finish, None))
        for r, finish, error in sorted(finishing, key=lambda item: -item[0].row):
            self._complete(r, *finish, error=error)

    def _accept(
        self, r: _Active, logits: torch.Tensor
    ) -> tuple[str, tuple[int, ...], str, tuple[TokenLogprob, ...]] | None:
        """Sample from ``logits`` and push the token; emits a delta unless the request ends (then
        returns its end: reason, ids, text, logprobs)."""
        token = r.sampler.sample(logits)
        k = r.request.sampling.logprobs
        lps: tuple[TokenLogprob, ...] = ()
        now = time.monotonic()
        if r.handle.first_token_at is None:
            r.handle.first_token_at = now
            self.metrics.ttft.observe(now - r.handle.submitted_at)
        else:
            self.metrics.itl.observe(now - r.last_token_at)
        r.last_token, r.last_token_at = token, now
        ids, text, reason = r.output.push(token)
        if k is not None and ids:
            lps = (token_logprob(logits, token, k),)
        if reason is None:
            if ids or text:
                r.handle._put(Delta(token_ids=ids, text=text, logprobs=lps))
            return None
        return reason, ids, text, lps

    # ---------------------------------------------------------------- rows and completion
    def _move_row(self, src: int, dst: int) -> None:
        for t in self._tensors:
            t[dst].copy_(t[src])

    def _swap_rows(self, a: int, b: int) -> None:
        for t in self._tensors:
            tmp = t[a].clone()
            t[a].copy_(t[b])
            t[b].copy_(tmp)

    def _free_row(self, r: _Active) -> None:
        if r.decoding:
            last = self._n_decode - 1
            if r.row != last:
                moved = self._rows[last]
                assert moved is not None
                self._move_row(last, r.row)
                moved.row, self._rows[r.row] = r.row, moved
            self._rows[last] = None
            self._n_decode -= 1
            r.decoding = False
        else:
            self._rows[r.row] = None
            if r in self._prefilling:
                self._prefilling.remove(r)
        if self.cache is not None and self.cache.device_pool is not None:
            self.cache.device_pool.release_window(id(r.handle))

    def _commit(self, r: _Active, tokens: list[int]) -> None:
        if self.cache is None:
            return
        try:
            self.cache.commit(
                tokens,
                self._row_views[r.row],
                0,
                r.request.salt,
                at_turn_end=True,
                images=_key_parts(r.request),
            )
        except Exception as exc:  # write-back is best effort; the request itself is fine
            self.metrics.commit_errors.inc()
            self._commit_faults.failed(
                type(exc).__name__, f"committing a request's cache failed: {exc!r}", level=logging.ERROR
            )
        else:
            self._commit_faults.recovered()

    def _complete(
        self,
        r: _Active,
        reason: str,
        ids: tuple[int, ...] = (),
        text: str = "",
        logprobs: tuple[TokenLogprob, ...] = (),
        error: str | None = None,
    ) -> None:
        if reason in ("stop", "length") and len(r.output.sampled) > 1:
            # The model has processed the prompt and every sampled token but the last.
            self._commit(r, r.tokens + r.output.sampled[:-1])
        self._free_row(r)
        self._finish_handle(
            r.handle,
            Delta(
                token_ids=ids,
                text=text,
                finished=True,
                finish_reason=reason,
                accounting=r.accounting,
                error=error,
                logprobs=logprobs,
            ),
        )

    def _finish_handle(self, handle: EngineHandle, delta: Delta) -> None:
        handle._put(delta)
        self.metrics.finished.inc(delta.finish_reason or "stop")
        self.metrics.e2e.observe(time.monotonic() - handle.submitted_at)

    # ---------------------------------------------------------------- introspection
    def queue_depth(self) -> int:
        return len(self._waiting)

    def running(self) -> int:
        return sum(r is not None for r in self._rows)


def generate(engine: EngineAPI, prompt: str | Sequence[int], *, salt: bytes = b"", **sampling: Any) -> Result:
    """Generate for one prompt (text is tokenized with the engine's tokenizer, with bos) and wait.

    ``sampling`` holds SamplingParams fields (``max_tokens=32, temperature=0``, ...).
    """
    fields: dict[str, Any] = dict(sampling)
    for key in ("stop", "stop_token_ids"):
        if key in fields:
            fields[key] = (fields[key],) if isinstance(fields[key], str) else tuple(fields[key])
    params = SamplingParams(**fields)
    if isinstance(prompt, str):
        tokenizer = getattr(engine, "tokenizer", None) or ByteTokenizer()
        ids = tuple(tokenizer.encode(prompt, bos=True))
    else:
        ids = tuple(int(t) for t in prompt)
    return engine.generate(Request(ids, params, salt=salt))
