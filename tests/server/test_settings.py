"""Settings: defaults < config file < REPLAYKV_* environment < flags, names, errors, and the
EngineConfig / ServerSettings they build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replaykv.server import settings as settings_module
from replaykv.server import usage_text
from replaykv.server.settings import OPTIONS, SettingsError, build_parser, load_settings
from replaykv.server.tenants import DEFAULT_TENANT, key_tenant, tenant_salt

REPO = Path(__file__).resolve().parents[2]


def test_defaults() -> None:
    s = load_settings([], environ={})
    server = s.server()
    assert (server.host, server.port, server.admin_key, server.auth_enabled) == (
        "127.0.0.1",
        30000,
        None,
        False,
    )
    flags = s.replay_flags  # off unless enabled, as in SGLang
    assert not flags.enable_encoder_swa_bounded_replay and not flags.enable_decoder_swa_bounded_replay
    assert flags.miss_strategy == "exact"
    assert all(src == "default" for src in s.sources.values())


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "port: 1111\nhost: 0.0.0.0\nswa-pool: redis\nmax_running_requests: 3\nadmin_key: from-file\n"
    )
    env = {"REPLAYKV_PORT": "2222", "REPLAYKV_SWA_POOL": "memory", "REPLAYKV_CONFIG": str(cfg)}
    s = load_settings(["--port", "3333"], environ=env)
    assert s["port"] == 3333 and s.sources["port"] == "--port"  # flag > env > file
    assert s["swa_pool"] == "memory" and s.sources["swa_pool"] == "REPLAYKV_SWA_POOL"  # env > file
    assert s["host"] == "0.0.0.0" and s["max_running_requests"] == 3 and s["admin_key"] == "from-file"
    assert s.sources["host"].startswith("config file")
    s = load_settings([], environ={"REPLAYKV_PORT": "2222", "REPLAYKV_CONFIG": str(cfg)})
    assert s["port"] == 2222
    js = tmp_path / "serve.json"
    js.write_text(json.dumps({"port": 4444, "api_key": {"k1": "alice"}}))
    s = load_settings(["--config", str(js)], environ={"REPLAYKV_CONFIG": str(cfg)})  # --config wins
    assert s["port"] == 4444 and s.server().api_keys == {"k1": "alice"}


def test_replay_switches_from_every_source(tmp_path: Path) -> None:
    off = ["--disable-encoder-swa-bounded-replay", "--disable-decoder-swa-bounded-replay"]
    flags = load_settings(off, environ={}).replay_flags
    assert not flags.enable_encoder_swa_bounded_replay and not flags.enable_decoder_swa_bounded_replay
    assert flags.miss_strategy == "exact"
    env = {"REPLAYKV_ENABLE_DECODER_SWA_BOUNDED_REPLAY": "off"}
    assert not load_settings([], environ=env).replay_flags.enable_decoder_swa_bounded_replay
    assert load_settings(
        ["--enable-decoder-swa-bounded-replay"], environ=env
    ).replay_flags.enable_decoder_swa_bounded_replay
    cfg = tmp_path / "c.yaml"
    cfg.write_text("enable_encoder_swa_bounded_replay: false\nswa_miss_strategy: truncate\n")
    flags = load_settings(["--config", str(cfg)], environ={}).replay_flags
    assert not flags.enable_encoder_swa_bounded_replay and flags.miss_strategy == "truncate"


def test_api_keys_forms() -> None:
    s = load_settings(["--api-key", "k1=alice", "--api-key", "k2=bob", "--api-key", "solo"], environ={})
    assert s.server().api_keys == {"k1": "alice", "k2": "bob", "solo": key_tenant("solo")}
    assert key_tenant("solo").startswith("key-") and key_tenant("solo") != key_tenant("duo")
    assert "solo" not in key_tenant("solo") and DEFAULT_TENANT not in s.server().api_keys.values()
    s = load_settings(["--api-key", "solo=default"], environ={})
    assert s.server().api_keys == {"solo": DEFAULT_TENANT}
    help_text = " ".join(build_parser().format_help().split())
    assert "a bare KEY is its own tenant" in help_text and "only as KEY=default" in help_text
    s = load_settings([], environ={"REPLAYKV_API_KEY": "k1=alice, k2=bob"})
    assert s.server().api_keys == {"k1": "alice", "k2": "bob"}
    with pytest.raises(SettingsError, match="two tenants"):
        load_settings(["--api-key", "k=a", "--api-key", "k=b"], environ={})
    with pytest.raises(SettingsError, match="KEY=TENANT"):
        load_settings(["--api-key", "k="], environ={})
    with pytest.raises(SettingsError, match="admin key must differ"):
        load_settings(["--api-key", "k=a", "--admin-key", "k"], environ={})


@pytest.mark.parametrize(
    ("argv", "env", "match"),
    [
        ([], {"REPLAYKV_PORT": "eighty"}, "REPLAYKV_PORT"),
        ([], {"REPLAYKV_ENABLE_DECODER_SWA_BOUNDED_REPLAY": "maybe"}, "REPLAYKV_ENABLE_DECODER"),
        ([], {"REPLAYKV_SWA_POOL": "disk"}, "REPLAYKV_SWA_POOL"),
        ([], {"REPLAYKV_STORE_FORMAT": "sqlite"}, "REPLAYKV_STORE_FORMAT"),
        (["--max-running-requests", "0"], {}, "--max-running-requests"),
        (["--port", "70000"], {}, "port"),
        (["--context-length", "0"], {}, "--context-length"),
        (["--swa-pool-ttl", "-1"], {}, "TTL"),
        (["--config", "/nonexistent/serve.yaml"], {}, "cannot read"),
    ],
)
def test_bad_values_name_their_source(argv: list[str], env: dict[str, str], match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        load_settings(argv, environ=env)


def test_bad_config_files(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prot: 80\n")
    with pytest.raises(SettingsError, match="unknown setting 'prot'"):
        load_settings(["--config", str(cfg)], environ={})
    cfg.write_text("- a list\n")
    with pytest.raises(SettingsError, match="mapping"):
        load_settings(["--config", str(cfg)], environ={})
    bad = tmp_path / "c.json"
    bad.write_text("{port: 1}")
    with pytest.raises(SettingsError, match="does not parse"):
        load_settings(["--config", str(bad)], environ={})


def test_unknown_environment_variables_warn() -> None:
    s = load_settings([], environ={"REPLAYKV_PROT": "80"})
    assert any("REPLAYKV_PROT" in w for w in s.warnings)


def test_flag_names() -> None:
    help_text = build_parser().format_help()
    for flag in (
        "--host",
        "--port",
        "--model",
        "--enable-encoder-swa-bounded-replay",
        "--disable-encoder-swa-bounded-replay",
        "--enable-decoder-swa-bounded-replay",
        "--disable-decoder-swa-bounded-replay",
        "--swa-miss-strategy",
        "--swa-pool",
        "--redis-url",
        "--swa-pool-ttl",
        "--cache-dir",
        "--store-format",
        "--max-running-requests",
        "--max-queued-requests",
        "--chunked-prefill-size",
        "--api-key",
        "--admin-key",
        "--dtype",
        "--device",
        "--seed",
        "--config",
    ):
        assert flag in help_text, flag
    for opt in OPTIONS:
        assert opt.env in help_text


def test_engine_config_mapping(tmp_path: Path) -> None:
    argv = [
        "--preset",
        "tiny",
        "--max-running-requests",
        "3",
        "--max-queued-requests",
        "5",
        "--chunked-prefill-size",
        "64",
        "--context-length",
        "1024",
        "--swa-pool-ttl",
        "9",
        "--cache-dir",
        str(tmp_path),
        "--enable-encoder-swa-bounded-replay",
        "--disable-decoder-swa-bounded-replay",
        "--seed",
        "7",
        "--served-model-name",
        "mine",
        "--decode-threads",
        "2",
    ]
    cfg = load_settings(argv, environ={}).engine_config()
    assert cfg.decode_threads == 2
    assert load_settings([], environ={}).engine_config().decode_threads == 1
    with pytest.raises(SettingsError, match="decode_threads must be >= 0"):
        load_settings(["--decode-threads", "-1"], environ={}).engine_config()
    assert (cfg.preset, cfg.max_batch, cfg.max_queue, cfg.prefill_token_budget, cfg.max_context) == (
        "tiny",
        3,
        5,
        64,
        1024,
    )
    assert (cfg.swa_pool_ttl_s, cfg.store_dir, cfg.seed, cfg.model_name) == (9.0, str(tmp_path), 7, "mine")
    assert cfg.enable_encoder_swa_bounded_replay and not cfg.enable_decoder_swa_bounded_replay
    assert cfg.model_dir is None
    off = load_settings(["--cache-dir", "off", "--swa-pool", "off"], environ={}).engine_config()
    assert off.store_dir is None and off.swa_pool is None
    assert cfg.store_format is None  # the format on disk, else pack
    assert load_settings(["--store-format", "file"], environ={}).engine_config().store_format == "file"
    with pytest.raises(SettingsError, match="redis_url"):
        load_settings(["--swa-pool", "redis"], environ={}).engine_config()
    with pytest.raises(SettingsError, match="not a directory"):
        load_settings(["--model", str(tmp_path / "missing")], environ={}).engine_config()


def test_tenant_salt() -> None:
    assert tenant_salt("alice") == tenant_salt("alice") and len(tenant_salt("alice")) == 32
    assert tenant_salt("alice") != tenant_salt("bob")
    assert tenant_salt("org_1") != tenant_salt("org_12345") != tenant_salt("")


def test_usage_text_is_pasteable() -> None:
    text = usage_text("http://127.0.0.1:8000", "m", auth=True)
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in text and "Bearer YOUR_API_KEY" in text
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1"' in text
    assert "Authorization" not in usage_text("http://h:1", "m", auth=False)


def test_a_named_preset_wins_over_the_bundled_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundled = tmp_path / "weights" / "small"
    bundled.mkdir(parents=True)
    monkeypatch.setattr(settings_module, "BUNDLED_MODEL_DIR", bundled)
    assert load_settings([], environ={}).model_dir is None  # nothing bundled yet
    (bundled / "config.json").write_text("{}")
    assert load_settings([], environ={}).model_dir == bundled
    assert load_settings(["--preset", "tiny"], environ={}).model_dir is None
    assert load_settings([], environ={"REPLAYKV_PRESET": "tiny"}).model_dir is None
    assert load_settings(["--model", str(tmp_path)], environ={}).model_dir == tmp_path
    # the same rule for `generate` and `accept`, whose --preset defaults to None
    assert settings_module.model_to_load(None, preset_named=False) == bundled
    assert settings_module.model_to_load(None, preset_named=True) is None
    assert settings_module.model_to_load(str(tmp_path), preset_named=True) == tmp_path


def test_a_stage_checkpoint_below_the_bar_is_not_served_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundled = tmp_path / "weights" / "small"
    bundled.mkdir(parents=True)
    monkeypatch.setattr(settings_module, "BUNDLED_MODEL_DIR", bundled)
    (bundled / "config.json").write_text("{}")
    (bundled / "stage.json").write_text('{"recipe": "small", "stage": 1, "rung": null}')
    assert load_settings([], environ={}).model_dir is None  # committed to continue training only
    assert load_settings(["--model", str(bundled)], environ={}).model_dir == bundled
    (bundled / "stage.json").write_text('{"recipe": "small", "stage": 4, "rung": 1}')
    assert load_settings([], environ={}).model_dir == bundled
    (bundled / "stage.json").write_text("not json")
    assert settings_module.model_to_load(None, preset_named=False) is None


def test_log_level_reaches_the_replaykv_loggers(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from replaykv.server import configure_logging

    top = logging.getLogger("replaykv")
    before = list(top.handlers), top.level
    tier = logging.getLogger("replaykv.cache.swa_pool")
    try:
        configure_logging("warning")
        tier.info("an info line")
        tier.warning("Redis SWA pool at redis://x: connection error")
        err = capsys.readouterr().err
        assert (
            "WARNING replaykv.cache.swa_pool: Redis SWA pool at redis://x" in err
            and "an info line" not in err
        )
        configure_logging("info")
        tier.info("an info line")
        assert capsys.readouterr().err.count("an info line") == 1  # one handler, not two
    finally:
        top.handlers[:] = before[0]
        top.setLevel(before[1])


def test_make_serve_enables_both_replays_and_the_banner_says_so() -> None:
    from replaykv.server import replay_banner

    line = next(ln for ln in (REPO / "Makefile").read_text().splitlines() if "replaykv serve" in ln)
    argv = line.split("replaykv serve", 1)[1].split()
    banner = replay_banner(load_settings(argv, environ={}))
    assert banner == (
        "replaykv: encoder bounded replay on (from --enable-encoder-swa-bounded-replay; "
        "--disable-encoder-swa-bounded-replay to turn it off), decoder bounded replay on (from "
        "--enable-decoder-swa-bounded-replay; --disable-decoder-swa-bounded-replay to turn it off)"
    )
    env = {"REPLAYKV_ENABLE_DECODER_SWA_BOUNDED_REPLAY": "on"}
    assert "decoder bounded replay on (from REPLAYKV_ENABLE_DECODER_SWA_BOUNDED_REPLAY;" in replay_banner(
        load_settings([], environ=env)
    )
    off = replay_banner(load_settings(["--disable-encoder-swa-bounded-replay"], environ={}))
    assert off.startswith(
        "replaykv: encoder bounded replay off (from --disable-encoder-swa-bounded-replay; "
        "--enable-encoder-swa-bounded-replay to turn it on)"
    )
