"""Every setting of `replaykv serve`, read in one place.

Precedence, lowest first: the defaults below < a config file (``--config FILE`` or
``REPLAYKV_CONFIG``; YAML, or JSON when the name ends in ``.json``) < ``REPLAYKV_*``
environment variables < command-line flags. One table (:data:`OPTIONS`) names each setting
once; its flag is ``--`` + the name with dashes (SGLang's names where SGLang has the option),
its environment variable ``REPLAYKV_`` + the name in capitals, its config-file key the name
with underscores or dashes. Booleans take ``--enable-X`` / ``--disable-X`` flags and
``1/0, true/false, yes/no, on/off`` in the environment.

API keys and tenants: :mod:`replaykv.server.tenants`.

Written on argparse rather than pydantic-settings: every setting must also be a flag with help
and choices (argparse's job either way) and report which of the four layers it came from (the
start-up banner names it), and SGLang-style ``--enable-X`` / ``--disable-X`` pairs; the table
below does all three with no second declaration, which pydantic-settings would not shorten.

Engine options left unset keep the engine's own defaults (:class:`EngineConfig`'s).

Not for: parsing the options of other subcommands, or HTTP (see :mod:`replaykv.server.app`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from replaykv.cache.redis_url import redacted_url
from replaykv.cache.stores import STORE_FORMATS, capacity_bytes, parse_capacity
from replaykv.cli_parser import ArgumentParser
from replaykv.images import ImageLimits
from replaykv.model.presets import all_presets
from replaykv.replay import FAULTS, MISS_STRATEGIES, ReplayFlags
from replaykv.server.tenants import parse_keys

if TYPE_CHECKING:
    from replaykv.engine.config import EngineConfig

ENV_PREFIX = "REPLAYKV_"
BUNDLED_MODEL_DIR = Path(__file__).resolve().parent.parent / "weights" / "small"
"""Where a trained model shipped with the package lives (config.json + safetensors), if any."""


def bundled_model_ships(directory: Path | None = None) -> bool:
    """Whether `directory` holds a model that is served by default: a checkpoint whose stage.json
    (written by `replaykv train`) records that it met the shipping bar (``"rung"`` ≥ 1). A stage
    checkpoint below the bar is committed there so that training continues on another machine,
    but is served only when named with --model. `directory` defaults to the package's."""
    directory = BUNDLED_MODEL_DIR if directory is None else directory
    if not (directory / "config.json").is_file():
        return False
    stage = directory / "stage.json"
    if not stage.is_file():
        return True
    try:
        rung = json.loads(stage.read_text()).get("rung")
    except (OSError, ValueError):
        return False
    return isinstance(rung, int) and rung >= 1


def model_to_load(model: str | None, preset_named: bool) -> Path | None:
    """The model directory a command loads: `model` when given, else the model shipped inside
    the package (see :func:`bundled_model_ships`) unless a preset was named (a named preset
    means random weights of that shape); None means the preset."""
    if model:
        return Path(model)
    if preset_named or not bundled_model_ships():
        return None
    return BUNDLED_MODEL_DIR


class SettingsError(ValueError):
    """A setting has a bad value; the message names the flag, variable or file key to change."""


def _to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")


def _to_int(raw: Any) -> int:
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
        raise ValueError(f"expected an integer, got {raw!r}")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"expected an integer, got {raw!r}") from None


def _to_float(raw: Any) -> float:
    if isinstance(raw, bool):
        raise ValueError(f"expected a number, got {raw!r}")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"expected a number, got {raw!r}") from None


def _to_str(raw: Any) -> str:
    if not isinstance(raw, str | int | float) or isinstance(raw, bool):
        raise ValueError(f"expected a string, got {raw!r}")
    return str(raw)


@dataclass(frozen=True)
class Option:
    """One setting: its name (attribute, flag, variable and file key), parser, default and help."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    engine: bool = False  # an EngineConfig option (unset = the engine's default)
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def is_bool(self) -> bool:
        return self.parse is _to_bool


# fmt: off
OPTIONS: tuple[Option, ...] = (
    Option("host", _to_str, "127.0.0.1", "address to listen on"),
    Option("port", _to_int, 30000, "port to listen on"),
    Option("model", _to_str, None, "model directory (config.json + safetensors); default: --preset when given, else the bundled model"),
    Option("preset", _to_str, "small", "preset with random weights; used when given without --model, or when no model is bundled", choices=tuple(sorted(all_presets()))),
    Option("served_model_name", _to_str, None, "model name in the API (default: the engine's model name)"),
    Option("api_key", parse_keys, (), "KEY=TENANT: accept KEY for TENANT (repeatable); a bare KEY is its own tenant 'key-<sha256 prefix>', and shares tenant 'default' (the one without authentication) only as KEY=default; none = no authentication, tenant 'default'", metavar="KEY[=TENANT]"),
    Option("admin_key", _to_str, None, "bearer key of the /admin endpoints (unset = admin endpoints refused)"),
    Option("log_level", _to_str, "info", "uvicorn log level", choices=("critical", "error", "warning", "info", "debug")),
    Option("enable_encoder_swa_bounded_replay", _to_bool, False, "on a window-snapshot miss replay the last W tokens; off (the default, as in SGLang): the exact rebuild"),
    Option("enable_decoder_swa_bounded_replay", _to_bool, False, "run decoder layers over only the last W prompt tokens; off (the default, as in SGLang): over the whole prompt"),
    Option("swa_miss_strategy", _to_str, "bounded", "how a window-snapshot miss is rebuilt", choices=MISS_STRATEGIES),
    Option("replay_span", _to_int, None, "W of bounded replay in tokens (default: the model's window)"),
    Option("swa_pool", _to_str, None, "where window snapshots live ('off': nowhere)", choices=("memory", "redis", "off"), engine=True),
    Option("redis_url", _to_str, None, "Redis URL of --swa-pool redis, e.g. redis://127.0.0.1:6379/0; a comma-separated list of seed nodes is a Redis Cluster", engine=True),
    Option("redis_cluster", _to_bool, None, "--redis-url names a Redis Cluster (any one node of it is enough as a seed)", engine=True),
    Option("swa_pool_ttl", _to_float, None, "seconds a window snapshot stays in the pool", engine=True),
    Option("cache_dir", _to_str, None, "directory of the persistent global-KV store ('off': no store)", engine=True),
    Option("store_capacity", parse_capacity, None, "bound on the store's bytes: with units (500GB, 2GiB) or a share of its file system (0.5, 50%%); default 16 GiB; on a full disk the oldest-used packs are evicted and the write retried once", metavar="SIZE", engine=True),
    Option("store_format", _to_str, None, "layout of a new store: 'pack' (a file per written batch, the default) or 'file' (a file per entry); an existing store keeps its own", choices=STORE_FORMATS, engine=True),
    Option("store_shared", _to_bool, None, "other replaykv processes (replicas on one shared file system) write --cache-dir too: the 'file' format, entries they publish found on disk", engine=True),
    Option("context_length", _to_int, None, "tokens per request, prompt + generated", engine=True),
    Option("max_running_requests", _to_int, None, "requests decoded together", engine=True),
    Option("max_queued_requests", _to_int, None, "waiting requests before 429", engine=True),
    Option("chunked_prefill_size", _to_int, None, "prompt tokens prefilled per engine step", engine=True),
    Option("decode_threads", _to_int, None, "intra-op CPU threads of a decode step (0: torch's setting, as prefill uses); default 1", engine=True),
    Option("dtype", _to_str, None, "weights and caches dtype", choices=("float32", "bfloat16", "float16"), engine=True),
    Option("device", _to_str, None, "torch device, e.g. cpu or cuda", engine=True),
    Option("seed", _to_int, None, "seed of a preset's random weights and of sampling", engine=True),
    Option("max_image_bytes", _to_int, 8 * 1024 * 1024, "largest image accepted, in encoded bytes (after base64 decoding); the request body limit applies too"),
    Option("max_image_pixels", _to_int, 16 * 1024 * 1024, "largest image accepted, in pixels (width × height), checked before the pixels are decoded"),
    Option("max_images_per_request", _to_int, 8, "most images one chat request may carry"),
    Option("inject_fault", _to_str, None, "a deliberately wrong replay, to test acceptance contracts (never in production)", choices=FAULTS, engine=True),
)
# fmt: on
_BY_NAME = {o.name: o for o in OPTIONS}
ENGINE_FIELDS = {
    "max_running_requests": "max_batch",
    "max_queued_requests": "max_queue",
    "chunked_prefill_size": "prefill_token_budget",
    "context_length": "max_context",
    "swa_pool_ttl": "swa_pool_ttl_s",
    "cache_dir": "store_dir",
    "store_capacity": "store_capacity_bytes",
    "inject_fault": "fault",
}
"""Setting name → EngineConfig field, where they differ (settings follow SGLang's flag names)."""
_REPLAY_OPTIONS = (
    "enable_encoder_swa_bounded_replay",
    "enable_decoder_swa_bounded_replay",
    "swa_miss_strategy",
    "replay_span",
)


@dataclass(frozen=True)
class ServerSettings:
    """What the HTTP layer needs: where to listen, who may call, and under which model name.

    api_keys: key → tenant. Empty means no authentication: every request is tenant
    ``default``. admin_key: the bearer key of ``/admin/*`` (None refuses them all).
    model_dir: where the tokenizer and ``chat_template.json`` come from (None: the built-ins).
    default_max_tokens: a chat request's max_tokens when it gives none (capped by the context).
    max_image_bytes / max_image_pixels / max_images_per_request: what a chat request's images
    may be (:attr:`image_limits`); larger ones are refused with a 400 naming the limit.
    server_args: every setting with secrets redacted, as ``/get_server_info`` shows them.
    """

    host: str = "127.0.0.1"
    port: int = 30000
    api_keys: Mapping[str, str] = field(default_factory=dict)
    admin_key: str | None = None
    model_name: str | None = None
    model_dir: str | None = None
    log_level: str = "info"
    max_request_bytes: int = 32 * 1024 * 1024  # room for an image at --max-image-bytes in base64
    default_max_tokens: int = 256
    max_image_bytes: int = 8 * 1024 * 1024
    max_image_pixels: int = 16 * 1024 * 1024
    max_images_per_request: int = 8
    server_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port must be in [0, 65535], got {self.port} (--port / REPLAYKV_PORT)")
        for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise SettingsError(f"{name} must be >= 1, got {getattr(self, name)} ({flag})")
        if self.admin_key is not None and self.admin_key in self.api_keys:
            raise SettingsError("the admin key must differ from every API key (--admin-key / --api-key)")
        if self.admin_key == "":
            raise SettingsError("--admin-key must not be empty (leave it unset to refuse /admin)")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @property
    def image_limits(self) -> ImageLimits:
        """What one chat request's images may be (checked before and while decoding)."""
        return ImageLimits(self.max_image_bytes, self.max_image_pixels, self.max_images_per_request)


@dataclass(frozen=True)
class Settings:
    """Every value of `replaykv serve` after merging; `sources` says where each came from."""

    values: Mapping[str, Any]
    sources: Mapping[str, str]
    config_file: str | None = None
    warnings: tuple[str, ...] = ()

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    @property
    def model_dir(self) -> Path | None:
        """The model directory to load: --model, else the bundled model when one is shipped and no
        preset was asked for (a preset named anywhere, flag, file or environment, means random
        weights of that shape)."""
        return model_to_load(self.values["model"], self.sources["preset"] != "default")

    @property
    def replay_flags(self) -> ReplayFlags:
        try:
            return ReplayFlags(**{name: self.values[name] for name in _REPLAY_OPTIONS})
        except ValueError as e:
            raise SettingsError(str(e)) from e

    def server(self) -> ServerSettings:
        return ServerSettings(
            host=self.values["host"],
            port=self.values["port"],
            api_keys=dict(self.values["api_key"]),
            admin_key=self.values["admin_key"],
            model_name=self.values["served_model_name"],
            model_dir=str(self.model_dir) if self.model_dir is not None else None,
            log_level=self.values["log_level"],
            max_image_bytes=self.values["max_image_bytes"],
            max_image_pixels=self.values["max_image_pixels"],
            max_images_per_request=self.values["max_images_per_request"],
            server_args=self.redacted(),
        )

    def redacted(self) -> dict[str, Any]:
        """Every setting by name, keys replaced by how many there are and a Redis password by
        ``***`` (for /get_server_info)."""
        out = {name: value for name, value in self.values.items() if name not in ("api_key", "admin_key")}
        if out.get("redis_url"):
            out["redis_url"] = redacted_url(out["redis_url"])
        out["api_keys"] = len(self.values["api_key"])
        out["admin_endpoints"] = self.values["admin_key"] is not None
        return out

    def engine_config(self) -> EngineConfig:
        """The engine's config: model source, replay switches and every engine option that was set
        (the others keep EngineConfig's defaults)."""
        from replaykv.engine.config import EngineConfig, default_store_dir

        model_dir = self.model_dir
        kwargs: dict[str, Any] = {
            "model_dir": str(model_dir) if model_dir is not None else None,
            "preset": self.values["preset"],
            "model_name": self.values["served_model_name"],
        }
        kwargs.update({name: self.values[name] for name in _REPLAY_OPTIONS})
        for opt in OPTIONS:
            value = self.values[opt.name]
            if opt.engine and value is not None:
                if opt.name in ("swa_pool", "cache_dir") and value == "off":
                    value = None
                if opt.name == "store_capacity":
                    value = capacity_bytes(value, self.values["cache_dir"] or default_store_dir())
                kwargs[ENGINE_FIELDS.get(opt.name, opt.name)] = value
        try:
            return EngineConfig(**kwargs)
        except (TypeError, ValueError) as e:
            raise SettingsError(f"engine config: {e}") from e


def build_parser() -> argparse.ArgumentParser:
    """The `replaykv serve` parser. Every default is SUPPRESS so only flags given appear."""
    from replaykv.engine.config import EngineConfig

    engine_defaults = EngineConfig()
    p = ArgumentParser(
        prog="replaykv serve",
        description="OpenAI-compatible server. Each flag also reads from the config file and from "
        "REPLAYKV_<NAME> (precedence: flags > environment > config file > defaults).",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", help="YAML or JSON file of settings (env: REPLAYKV_CONFIG)")
    for opt in OPTIONS:
        default = opt.default
        if opt.engine and default is None:
            default = getattr(engine_defaults, ENGINE_FIELDS.get(opt.name, opt.name))
        shown = "" if "default" in opt.help else f"; default {'none' if default is None else default}"
        text = f"{opt.help} (env {opt.env}{shown})"
        if opt.is_bool and opt.name.startswith("enable_"):
            stem = opt.name.removeprefix("enable_").replace("_", "-")
            p.add_argument(f"--enable-{stem}", dest=opt.name, action="store_const", const=True, help=text)
            p.add_argument(f"--disable-{stem}", dest=opt.name, action="store_const", const=False)
        elif opt.is_bool:
            p.add_argument(opt.flag, dest=opt.name, action="store_const", const=True, help=text)
            p.add_argument(f"--no-{opt.flag[2:]}", dest=opt.name, action="store_const", const=False)
        elif opt.name == "api_key":
            p.add_argument(opt.flag, dest=opt.name, action="append", metavar=opt.metavar, help=text)
        else:
            names = [opt.flag, "--model-path"] if opt.name == "model" else [opt.flag]
            if opt.name == "admin_key":
                names.append("--admin-api-key")
            p.add_argument(*names, dest=opt.name, choices=opt.choices, metavar=opt.metavar, help=text)
    return p


def _parse(opt: Option, raw: Any, source: str) -> Any:
    try:
        value = opt.parse(raw)
    except (TypeError, ValueError) as e:
        raise SettingsError(f"{source}: {e}") from e
    if opt.choices is not None and value is not None and value not in opt.choices:
        raise SettingsError(f"{source}: must be one of {list(opt.choices)}, got {value!r}")
    return value


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SettingsError(f"cannot read config file {path}: {e}") from e
    try:
        raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise SettingsError(f"config file {path} does not parse: {e}") from e
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SettingsError(f"config file {path} must hold a mapping of setting names to values")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in _BY_NAME:
            raise SettingsError(f"config file {path}: unknown setting {key!r}; known: {sorted(_BY_NAME)}")
        out[name] = value
    return out


def load_settings(argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> Settings:
    """Merge defaults < config file < environment < flags. Raises SettingsError naming the source."""
    env = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(list(argv)))
    config_file = args.pop("config", None) or env.get(ENV_PREFIX + "CONFIG") or None
    values = {o.name: o.default for o in OPTIONS}
    sources = dict.fromkeys(values, "default")
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_file:
        layers.append((f"config file {config_file}", _read_file(config_file)))
    layers.append(("environment", {o.name: env[o.env] for o in OPTIONS if o.env in env}))
    layers.append(("command line", args))
    for where, given in layers:
        for name, raw in given.items():
            if raw is None:  # `key:` with no value in a file: keep the default
                continue
            opt = _BY_NAME[name]
            label = {"environment": opt.env, "command line": opt.flag}.get(where, f"{where} key {name!r}")
            values[name] = _parse(opt, raw, label)
            sources[name] = label
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k != ENV_PREFIX + "CONFIG")
    unknown = [k for k in unknown if k not in {o.env for o in OPTIONS}]
    warnings = (
        [f"ignoring unknown environment variables {unknown} (known: {[o.env for o in OPTIONS]})"]
        if unknown
        else []
    )
    for name in (
        "max_running_requests",
        "max_queued_requests",
        "chunked_prefill_size",
        "replay_span",
        "context_length",
        "max_image_bytes",
        "max_image_pixels",
        "max_images_per_request",
    ):
        if values[name] is not None and values[name] < 1:
            raise SettingsError(f"{sources[name]}: {name} must be >= 1, got {values[name]}")
    if values["swa_pool_ttl"] is not None and not values["swa_pool_ttl"] > 0:
        raise SettingsError(f"{sources['swa_pool_ttl']}: the TTL must be > 0 seconds")
    settings = Settings(values, sources, config_file, tuple(warnings))
    settings.replay_flags  # noqa: B018  (validate the replay switches together)
    settings.server()  # validate the server part
    return settings
