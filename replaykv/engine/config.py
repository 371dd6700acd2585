"""The engine's configuration: one frozen dataclass, validated when it is built.

For: which model to run (a checkpoint directory, or a preset with random weights), where and in
what dtype, how many requests run at once and wait, the chunked-prefill budget, the replay
switches (named as SGLang names them) and the three cache ledgers (device pool, SWA pool,
global-KV store). Not for: parsing command lines or environment variables (entry points do that
and build an :class:`EngineConfig`), or the server's own settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from replaykv.cache.manager import WRITE_POLICIES
from replaykv.cache.stores import STORE_FORMATS
from replaykv.cache.swa_pool import SWA_POOL_BACKENDS
from replaykv.replay import FAULTS, MISS_STRATEGIES, ReplayFlags, ReplayOptionError, check_engine_options

DTYPES = ("float32", "bfloat16", "float16")


def default_store_dir() -> str:
    """Where `replaykv serve` and `replaykv store` keep the persistent global-KV store by default:
    ``$XDG_CACHE_HOME/replaykv/store``, or ``~/.cache/replaykv/store`` when that is unset or
    not absolute (the XDG base-directory rule)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return str(base / "replaykv" / "store")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`~replaykv.engine.engine.Engine` needs to start.

    Model: ``model_dir`` (a Hugging Face-format checkpoint) or, when it is None, ``preset`` with
    random weights drawn from ``seed`` (announced as such in ``model_name``). ``kv_quant`` None
    keeps the checkpoint's KV fake-quantisers; True/False overrides them (exactness tests turn
    them off). ``device`` is a torch device string, ``dtype`` the weights' and caches' dtype.

    Scheduling: ``max_batch`` decode slots (rows of the batched cache view), ``max_context``
    tokens per slot (prompt + generated), ``max_queue`` requests waiting for a slot (beyond that
    ``submit`` raises QueueFull), ``prefill_token_budget`` prompt rows run per engine step
    (chunked prefill; decode steps interleave with the chunks), ``decode_threads`` intra-op
    threads of a decode step on a CPU (0: torch's setting, which prefill always uses). A decode
    step is a few thousand small operators, for which a second thread's hand-offs cost more than
    they save (docs/benchmarks.md, "Decode threads"); its rows are the same bits either way.

    Replay: the ReplayFlags fields; ``speculative_decoding`` only exists for the start-up guard
    (the engine does not speculate) and is refused together with encoder bounded replay.

    Caches: ``swa_pool`` "memory" | "redis" | None (off) with ``redis_url`` (``redis_cluster``: it
    names a Redis Cluster; a comma-separated list of seed nodes implies it), ``swa_pool_ttl_s``
    and ``swa_pool_capacity_bytes`` (memory pool; None = 10% of host memory);
    ``image_feature_cache_bytes`` (image span vectors kept by content digest for
    ``swa_pool_ttl_s``; 0 keeps none, so every image a prefill needs runs the tower); ``store_dir`` (None
    disables the persistent store) with ``store_format`` ("pack": a file per written batch,
    "file": a file per entry; None: what the directory holds, else "pack"), ``store_shared``
    (other processes write the directory too: the "file" format, entries adopted from disk),
    ``store_capacity_bytes`` and ``store_retention_s``;
    ``device_pool_bytes`` (0 disables the device pool); ``chunk_size`` tokens per global-KV chunk
    (a multiple of every compression ratio); ``write_policy`` "v41" (snapshots only in the SWA
    pool) or "v4" (also persisted); ``writeback_queue`` jobs queued for background write-back.

    Fault injection (``fault``, None in any real deployment): a deliberately wrong replay, so that
    an acceptance contract can be shown to catch it. "window_untruncated": bounded replay runs
    without its window floor and reads the stale window rings a missing snapshot leaves (filled
    with junk); "drop_global_kv": the cached global KV of a hit is zeroed after it is loaded.
    """

    model_dir: str | None = None
    preset: str = "small"
    seed: int = 0
    kv_quant: bool | None = None
    device: str = "cpu"
    dtype: str = "float32"
    model_name: str | None = None
    # scheduling
    max_batch: int = 8
    max_context: int = 4096
    max_queue: int = 256
    prefill_token_budget: int = 512
    decode_threads: int = 1
    # replay
    enable_encoder_swa_bounded_replay: bool = True
    enable_decoder_swa_bounded_replay: bool = True
    swa_miss_strategy: str = "bounded"
    replay_span: int | None = None
    speculative_decoding: bool = False
    # caches
    swa_pool: str | None = "memory"
    redis_url: str | None = None
    redis_cluster: bool = False
    swa_pool_ttl_s: float = 300.0
    image_feature_cache_bytes: int = 256 * 1024 * 1024
    swa_pool_capacity_bytes: int | None = None
    store_dir: str | None = field(default_factory=default_store_dir)
    store_format: str | None = None
    store_shared: bool = False
    store_capacity_bytes: int = 16 << 30
    store_retention_s: float | None = 72 * 3600.0
    device_pool_bytes: int = 256 << 20
    chunk_size: int = 256
    write_policy: str = "v41"
    writeback_queue: int = 64
    fault: str | None = None

    def __post_init__(self) -> None:
        if self.model_dir is not None and not Path(self.model_dir).is_dir():
            raise ValueError(f"model_dir {self.model_dir!r} is not a directory; give a checkpoint directory")
        if self.model_dir is None:
            from replaykv.model.presets import all_presets

            if self.preset not in all_presets():
                raise ValueError(
                    f"unknown preset {self.preset!r}; choose one of {sorted(all_presets())} or set model_dir"
                )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose one of {DTYPES}")
        if not (self.device == "cpu" or self.device.startswith(("cuda", "mps"))):
            raise ValueError(f"device {self.device!r} is not a torch device string like 'cpu' or 'cuda:0'")
        for name in ("max_batch", "max_queue", "prefill_token_budget", "writeback_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.decode_threads < 0:
            raise ValueError(f"decode_threads must be >= 0 (0: torch's setting); got {self.decode_threads}")
        if self.max_context < 2:
            raise ValueError(
                f"max_context must be >= 2 tokens (a prompt token and a new one); got {self.max_context}"
            )
        if self.swa_miss_strategy not in MISS_STRATEGIES:
            raise ValueError(
                f"swa_miss_strategy must be one of {MISS_STRATEGIES}; got {self.swa_miss_strategy!r}"
            )
        if self.replay_span is not None and self.replay_span < 1:
            raise ValueError(
                f"replay_span must be a positive number of tokens or None; got {self.replay_span}"
            )
        try:
            check_engine_options(self.replay_flags, self.speculative_decoding)
        except ReplayOptionError as exc:
            raise ValueError(str(exc)) from exc
        if self.swa_pool is not None and self.swa_pool not in SWA_POOL_BACKENDS:
            raise ValueError(
                f"swa_pool must be one of {sorted(SWA_POOL_BACKENDS)} or None (off); got {self.swa_pool!r}"
            )
        if self.swa_pool == "redis" and not self.redis_url:
            raise ValueError("swa_pool 'redis' needs redis_url (e.g. redis://127.0.0.1:6379/0)")
        if self.redis_cluster and self.swa_pool != "redis":
            raise ValueError(f"redis_cluster needs swa_pool 'redis'; got swa_pool {self.swa_pool!r}")
        if not self.swa_pool_ttl_s > 0:
            raise ValueError(f"swa_pool_ttl_s must be > 0 seconds; got {self.swa_pool_ttl_s}")
        if self.image_feature_cache_bytes < 0:
            raise ValueError(f"image_feature_cache_bytes must be >= 0; got {self.image_feature_cache_bytes}")
        if self.swa_pool_capacity_bytes is not None and self.swa_pool_capacity_bytes <= 0:
            raise ValueError("swa_pool_capacity_bytes must be > 0, or None for 10% of host memory")
        if self.store_format is not None and self.store_format not in STORE_FORMATS:
            raise ValueError(
                f"store_format must be one of {STORE_FORMATS} or None; got {self.store_format!r}"
            )
        if self.store_capacity_bytes <= 0:
            raise ValueError(f"store_capacity_bytes must be > 0; got {self.store_capacity_bytes}")
        if self.store_retention_s is not None and self.store_retention_s <= 0:
            raise ValueError("store_retention_s must be > 0 seconds, or None to keep entries until evicted")
        if self.device_pool_bytes < 0:
            raise ValueError(f"device_pool_bytes must be >= 0 (0 = off); got {self.device_pool_bytes}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of tokens; got {self.chunk_size}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS} or None; got {self.fault!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}; got {self.write_policy!r}")

    @property
    def replay_flags(self) -> ReplayFlags:
        """The engine-wide replay switches (a request may override them)."""
        return ReplayFlags(
            enable_encoder_swa_bounded_replay=self.enable_encoder_swa_bounded_replay,
            enable_decoder_swa_bounded_replay=self.enable_decoder_swa_bounded_replay,
            swa_miss_strategy=self.swa_miss_strategy,
            replay_span=self.replay_span,
        )

    @property
    def caching(self) -> bool:
        """Whether any cache ledger is on (otherwise every request is a cold prefill)."""
        return self.swa_pool is not None or self.store_dir is not None or self.device_pool_bytes > 0
