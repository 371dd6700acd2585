"""The OpenAI-compatible HTTP server (`replaykv serve`).

``create_app(engine, settings)`` builds the FastAPI app over any :class:`EngineAPI`;
:func:`main` is the command: read the settings, build the engine, say what was loaded and how
to call it, then run uvicorn until interrupted. Not for: engine logic (``replaykv.engine``).
"""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from replaykv.engine.api import EngineAPI
    from replaykv.server.settings import ServerSettings, Settings

__all__ = ["create_app", "main"]


def create_app(engine: EngineAPI, settings: ServerSettings) -> FastAPI:
    from replaykv.server.app import create_app as _create_app

    return _create_app(engine, settings)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one (read it from getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(
        family, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )  # IPPROTO_TCP: asyncio then sets TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _announce_model(settings: Settings) -> None:
    model_dir = settings.model_dir
    if model_dir is not None:
        where = "--model" if settings["model"] else "the bundled model"
        print(f"replaykv: loading {where}: {model_dir}", flush=True)
        return
    from replaykv.server.settings import BUNDLED_MODEL_DIR

    bar = "!" * 78
    staged = ""
    if not settings["model"] and (BUNDLED_MODEL_DIR / "config.json").is_file():
        staged = (
            f"!! {BUNDLED_MODEL_DIR} holds a training stage below the shipping bar\n"
            f"!! (its MODEL_CARD.md); serve it with --model {BUNDLED_MODEL_DIR}\n"
        )
    print(
        f"{bar}\n!! no trained model found: serving preset {settings['preset']!r} with RANDOM weights.\n"
        f"!! Everything it writes is noise; use --model DIR for a real checkpoint.\n{staged}{bar}",
        flush=True,
    )


def replay_banner(settings: Settings) -> str:
    """The replay switches as served, where each came from, and the flag that changes it (both
    are off unless enabled, as in SGLang)."""
    parts = []
    for name, what in (
        ("enable_encoder_swa_bounded_replay", "encoder"),
        ("enable_decoder_swa_bounded_replay", "decoder"),
    ):
        on = bool(settings[name])
        stem = name.removeprefix("enable_").replace("_", "-")
        given, other = (
            (f"--enable-{stem}", f"--disable-{stem}") if on else (f"--disable-{stem}", f"--enable-{stem}")
        )
        source = settings.sources[name]
        origin = "default" if source == "default" else f"from {given if source.startswith('--') else source}"
        parts.append(
            f"{what} bounded replay {'on' if on else 'off'} ({origin}; {other} to turn it {'off' if on else 'on'})"
        )
    return "replaykv: " + ", ".join(parts)


def usage_text(url: str, model: str, auth: bool) -> str:
    """What to paste to call the server: a curl command and an openai-client snippet."""
    key_header = ' -H "Authorization: Bearer YOUR_API_KEY"' if auth else ""
    key = '"YOUR_API_KEY"' if auth else '"none"'
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 16}}'
    return (
        f"replaykv: serving at {url}\n\n"
        f'Try it:\n  curl {url}/v1/chat/completions -H "Content-Type: application/json"{key_header} \\\n'
        f"    -d '{body}'\n\n"
        "Or from Python:\n"
        "  from openai import OpenAI\n"
        f'  client = OpenAI(base_url="{url}/v1", api_key={key})\n'
        f'  r = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello"}}], max_tokens=16)\n'
        "  print(r.choices[0].message.content, r.usage)\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`replaykv serve [flags]`: returns the exit status (2 for bad settings)."""
    from replaykv.cli_parser import UsageError, check_device
    from replaykv.server.settings import SettingsError, load_settings

    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv)
        if settings["device"] is not None:
            check_device(settings["device"])
        config = settings.engine_config()
        server_settings = settings.server()
    except (SettingsError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for warning in settings.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    try:
        sock = bind(server_settings.host, server_settings.port)
    except OSError as e:
        print(f"error: cannot listen on {server_settings.host}:{server_settings.port}: {e}", file=sys.stderr)
        return 2
    _announce_model(settings)
    configure_logging(server_settings.log_level)

    import uvicorn

    from replaykv.engine.engine import Engine
    from replaykv.server.chat import ChatTemplateError

    try:
        engine = Engine(config)
    except (ValueError, OSError) as e:
        print(f"error: the engine did not start: {e}", file=sys.stderr)
        sock.close()
        return 2
    try:
        try:
            app = create_app(engine, server_settings)
        except ChatTemplateError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(
            f"replaykv: loaded {engine.model_name} (context {engine.max_context} tokens, {config.device}, "
            f"{config.dtype}); SWA pool {config.swa_pool or 'off'}, store {config.store_dir or 'off'}",
            flush=True,
        )
        print(replay_banner(settings), flush=True)
        _check_redis(engine)
        if config.fault is not None:
            print(
                f"replaykv: WARNING: fault {config.fault!r} injected: replay is deliberately wrong "
                "(for testing acceptance contracts only)",
                flush=True,
            )
        if not server_settings.auth_enabled:
            print(
                "replaykv: no --api-key given: no authentication, every request is tenant 'default'",
                flush=True,
            )
        host, port = sock.getsockname()[:2]
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else (f"[{host}]" if ":" in host else host)
        print(
            usage_text(f"http://{shown}:{port}", app.state.service.model_name, server_settings.auth_enabled),
            flush=True,
        )
        config_ = uvicorn.Config(app, log_level=server_settings.log_level, timeout_graceful_shutdown=5)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal; make that
        # an exception here so the engine still flushes its write-back below.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _stopped)
        uvicorn.Server(config_).run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        print("replaykv: stopping the engine (flushing write-back)", flush=True)
        engine.shutdown()
        sock.close()
    return 0


def configure_logging(level: str) -> None:
    """Send the ``replaykv`` loggers (cache tiers, engine, server) to stderr at `level`
    (``--log-level``); uvicorn configures its own loggers from the same setting."""
    import logging

    logger = logging.getLogger("replaykv")
    logger.setLevel(level.upper())
    if not any(getattr(h, "_replaykv", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._replaykv = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


def _check_redis(engine: object) -> None:
    """PING the Redis SWA pool once at start-up and say whether it answers (a pool that does not
    is a miss on every lookup until it does; the server still starts)."""
    pool = getattr(getattr(engine, "cache", None), "swa_pool", None)
    ping = getattr(pool, "ping", None)
    if ping is None:
        return
    address = getattr(pool, "address", "Redis")
    if ping():
        print(f"replaykv: SWA pool Redis at {address} answers PING", flush=True)
        return
    message = (
        f"SWA pool Redis at {address} does not answer PING (check --redis-url): every window "
        "snapshot is a miss, rebuilt by replay, until it does"
    )
    print(f"replaykv: WARNING: {message}", file=sys.stderr, flush=True)


class _Stopped(Exception):
    """SIGINT or SIGTERM after uvicorn's graceful shutdown."""


def _stopped(signum: int, frame: object) -> None:
    raise _Stopped(signum)
