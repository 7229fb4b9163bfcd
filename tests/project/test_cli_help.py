"""Every flag of every command: documented in --help with its default and environment variable, and
that variable really sets it."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from encoder_common.env_flags import comma_separated, config_from_args
from encoder_common.sources import SourcePolicy, networks, root_paths
from encoder_server import cli
from encoder_server.batcher import BatchingConfig
from encoder_server.config import ServerConfig, pixels_or_engine, port_or_off
from encoder_server.sglang.config import sglang_release
from encoder_server.tls import TlsConfig
from encoder_server.transports.shm import ShmConfig
from gateway import cli as gateway_cli
from gateway.config import GatewayConfig
from precompute import command as precompute
from receiver import cli as client_cli
from receiver.config import ReceiverConfig
from testkit import REPO_ROOT

# command -> (module, parser builder, env prefix, arguments a valid command line needs)
COMMANDS = {
    "encoder-server": ("encoder_server", cli.build_parser, "ENCODER_", []),  # --model: from ENCODER_MODEL below
    "encoder-client": ("receiver.cli", client_cli.build_parser, "ENCODER_CLIENT_", ["cat.png"]),
    "encoder-precompute": ("precompute", precompute.build_parser, "ENCODER_PRECOMPUTE_", ["images/"]),
    # --engine-url, --encoders: from ENCODER_GATEWAY_* below
    "encoder-gateway": ("gateway", gateway_cli.build_parser, "ENCODER_GATEWAY_", []),
}


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def env_name(prefix: str, action: argparse.Action) -> str:
    long_name = next(o for o in action.option_strings if o.startswith("--"))
    return prefix + long_name[2:].upper().replace("-", "_")


def help_entries(text: str) -> dict[str, str]:
    """--help's options section: each option's whole entry, whitespace collapsed."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^  (--[\w-]+)", line)
        if match:
            current = match.group(1)
            entries[current] = ""
        elif not line.startswith("   "):
            current = None
        if current:
            entries[current] += " " + line.strip()
    return {flag: " ".join(entry.split()) for flag, entry in entries.items()}


@pytest.mark.parametrize("command", COMMANDS)
def test_help_documents_every_flag_with_its_default_and_env_var(command):
    module, build, prefix, _ = COMMANDS[command]
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {command} ")
    entries = help_entries(done.stdout)
    parser = build()
    flags = options(parser)
    assert len(flags) >= 5
    for action in flags:
        entry = entries.get(action.option_strings[-1])
        assert entry is not None, f"{command} --help does not list {action.option_strings}"
        default = action.default
        assert f"[env {env_name(prefix, action)}; default: {default}]" in entry, entry
        assert entry.split(" [env")[0].split(maxsplit=1)[-1], f"{action.option_strings} has no description"


def sample_value(action: argparse.Action) -> tuple[str, object]:
    """An environment value different from the flag's default, and what it should parse to."""
    if isinstance(action, argparse._StoreTrueAction):
        return "true", True
    if action.choices:
        choice = next(c for c in action.choices if c != action.default)
        return choice, choice
    if action.type is int:
        return "7", 7
    if action.type is float:
        return "2.5", 2.5
    if action.type is port_or_off:
        return "9100", 9100
    if action.type is pixels_or_engine:
        return "1000000", 1000000
    if action.type is Path:
        return "/from-env", Path("/from-env")
    if action.type is comma_separated:
        return "a, b", ("a", "b")
    if action.type is root_paths:
        return "/a,/b", (Path("/a"), Path("/b"))
    if action.type is sglang_release:
        return "0.5.21", "0.5.21"
    if action.type is networks:
        return "10.1.2.3, fd00::/8", networks("10.1.2.3,fd00::/8")
    assert action.type is None, f"add a sample for {action.option_strings} (type {action.type})"
    return "from-env", "from-env"


def flag_text(value: object) -> str:
    """What to write on the command line for a parsed value: a tuple as its comma-separated items."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_reads_its_environment_variable(command, monkeypatch):
    _, build, prefix, required_args = COMMANDS[command]
    actions = options(build())
    for action in actions:
        monkeypatch.delenv(env_name(prefix, action), raising=False)
    monkeypatch.setenv("ENCODER_MODEL", "/models/base")  # the required flags, from the environment
    monkeypatch.setenv("ENCODER_PRECOMPUTE_OUT", "/cache/base")
    monkeypatch.setenv("ENCODER_GATEWAY_ENGINE_URL", "http://engine:8000")
    monkeypatch.setenv("ENCODER_GATEWAY_ENCODERS", "grpc://encoder:50051")
    defaults = vars(build().parse_args(required_args))
    for action in actions:
        raw, expected = sample_value(action)
        with monkeypatch.context() as env:
            env.setenv(env_name(prefix, action), raw)
            parsed = vars(build().parse_args(required_args))
        assert parsed[action.dest] == expected != defaults[action.dest], action.option_strings
        # ...and the command line still wins over the environment.
        if not isinstance(action, argparse._StoreTrueAction) and defaults[action.dest] is not None:
            with monkeypatch.context() as env:
                env.setenv(env_name(prefix, action), raw)
                flag = [action.option_strings[-1], flag_text(defaults[action.dest])]
                parsed = vars(build().parse_args([*required_args, *flag]))
            assert parsed[action.dest] == defaults[action.dest], action.option_strings


def clear_env(monkeypatch, command: str) -> None:
    _, build, prefix, _ = COMMANDS[command]
    for action in options(build()):
        monkeypatch.delenv(env_name(prefix, action), raising=False)


def test_the_server_flags_build_its_config_with_the_configs_own_defaults(monkeypatch):
    clear_env(monkeypatch, "encoder-server")
    assert config_from_args(ServerConfig, cli.build_parser().parse_args(["--model", "m"])) == ServerConfig(model="m")
    flags = ["--model", "m", "--batch-wait-ms", "2", "--file-roots", "/srv", "--no-warmup"]
    flags += ["--dtype", "float32"]
    flags += ["--tls-cert-file", "c.pem", "--tls-key-file", "k.pem", "--shm-transfer", "--shm-max-bytes", "1024"]
    monkeypatch.setenv("ENCODER_METRICS_PORT", "9100")
    assert config_from_args(ServerConfig, cli.build_parser().parse_args(flags)) == ServerConfig(
        model="m",
        batching=BatchingConfig(max_wait_ms=2.0),
        sources=SourcePolicy(file_roots=(Path("/srv"),)),
        warmup=False,
        dtype=torch.float32,
        tls=TlsConfig(cert_file="c.pem", key_file="k.pem"),
        shm=ShmConfig(max_bytes=1024),
        metrics_port=9100,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-cert-file", "c.pem"], "TLS needs both --tls-cert-file and --tls-key-file; --tls-key-file not given"),
        (["--tls-client-ca-file", "ca.pem"], "--tls-client-ca-file needs both .* --tls-cert-file and --tls-key-file not"),
    ],
)
def test_the_tls_config_refuses_a_half_pair(monkeypatch, flags, message):
    clear_env(monkeypatch, "encoder-server")
    with pytest.raises(ValueError, match=message):
        config_from_args(ServerConfig, cli.build_parser().parse_args(["--model", "m", *flags]))


def test_the_precompute_flags_build_its_settings_with_their_own_defaults(monkeypatch):
    clear_env(monkeypatch, "encoder-precompute")
    args = precompute.build_parser().parse_args(["images/", "--out", "/cache"])
    assert config_from_args(precompute.PrecomputeSettings, args) == precompute.PrecomputeSettings(out=Path("/cache"))
    args = precompute.build_parser().parse_args(["images/", "--out", "/cache", "--no-progress", "--dtype", "float16"])
    settings = config_from_args(precompute.PrecomputeSettings, args)
    assert settings.progress is False and settings.dtype == "float16" and settings.batch_size == 8
    assert settings.receiver == ReceiverConfig(timeout=600.0)  # a longer deadline than a prefill's


def test_the_precompute_flags_build_the_receivers_config_with_its_credentials(monkeypatch, tmp_path):
    clear_env(monkeypatch, "encoder-precompute")
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    flags = ["images/", "--out", "/cache", "--encoder-url", "grpcs://a:1", "--placement", "affinity"]
    flags += ["--encode-timeout", "30", "--auth-token-file", str(token)]
    settings = precompute.settings_from_args(precompute.build_parser().parse_args(flags))
    assert settings.receiver == ReceiverConfig(timeout=30.0, placement="affinity", auth_token="t0ken")


def test_the_gateway_flags_build_its_config_with_the_configs_own_defaults(monkeypatch):
    clear_env(monkeypatch, "encoder-gateway")
    required = ["--engine-url", "http://engine:8000", "--encoders", "grpc://a:1, grpc://b:2"]
    config = gateway_cli.config_from_args(gateway_cli.build_parser().parse_args(required))
    assert config == GatewayConfig(engine_url="http://engine:8000", encoders=("grpc://a:1", "grpc://b:2"))
    flags = ["--file-roots", "/srv,/data", "--encode-timeout", "5", "--engine-timeout", "30", "--pass-non-image"]
    flags += ["--handoff", "connector", "--retry-after", "3"]
    config = gateway_cli.config_from_args(gateway_cli.build_parser().parse_args([*required, *flags]))
    assert config == GatewayConfig(
        engine_url="http://engine:8000",
        encoders=("grpc://a:1", "grpc://b:2"),
        receiver=ReceiverConfig(timeout=5.0),
        engine_timeout_s=30.0,
        sources=SourcePolicy(file_roots=(Path("/srv"), Path("/data")), http_urls="public"),
        pass_non_image=True,
        handoff="connector",
        retry_after_s=3,
    )


def test_boolean_env_values(monkeypatch):
    for raw, expected in [("1", True), ("yes", True), ("TRUE", True), ("0", False), ("false", False)]:
        monkeypatch.setenv("ENCODER_NO_WARMUP", raw)
        assert cli.build_parser().parse_args(["--model", "m"]).no_warmup is expected


def test_model_may_come_from_the_environment_only(monkeypatch):
    monkeypatch.delenv("ENCODER_MODEL", raising=False)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([])
    monkeypatch.setenv("ENCODER_MODEL", "/models/m")
    assert cli.build_parser().parse_args([]).model == "/models/m"


def test_metrics_port_accepts_off_and_ports_only():
    assert port_or_off("off") is None and port_or_off("0") == 0 and port_or_off("9000") == 9000
    for bad in ("70000", "-1", "http"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            port_or_off(bad)


def test_console_scripts_point_at_the_commands():
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {
        "encoder-server": "encoder_server.cli:main",
        "encoder-client": "receiver.cli:main",
        "encoder-precompute": "precompute.cli:main",
        "encoder-gateway": "gateway.cli:main",
    }
    for command, (module, build, _, _) in COMMANDS.items():
        assert build().prog == command
