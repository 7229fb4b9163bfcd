"""--sglang-version: the flag (or ENCODER_SGLANG_VERSION) picks the EmbeddingData layout, an unknown release
fails start-up naming the known ones, and each release's own unpickler (from its wheel, run by
testkit/sglang_releases.py) accepts the pickle written for it and refuses one written for another layout.

tests/encoder_server/test_sglang_contract.py checks that a running server pushes the configured release's layout.
"""

from __future__ import annotations

import functools

import pytest

from encoder_common.env_flags import config_from_args
from encoder_server import cli
from encoder_server.config import ServerConfig
from encoder_server.sglang.config import SglangConfig
from encoder_server.sglang.embedding_data import LAYOUTS, SGLANG_VERSION, layout_for
from testkit.sglang_releases import check_release, read_sources, release_wheel

NEWEST, MIDDLE, OLDEST = (layout.last for layout in LAYOUTS)  # one release of each layout: 0.5.23, 0.5.22, 0.5.18


def server_config(argv: list[str]) -> ServerConfig:
    return config_from_args(ServerConfig, cli.build_parser().parse_args(["--model", "/m", *argv]))


def test_the_default_is_the_newest_release_in_the_table():
    config = server_config([])
    assert config.sglang.version == SGLANG_VERSION == LAYOUTS[0].last
    assert config.sglang.layout == LAYOUTS[0]


@pytest.mark.parametrize("version", ["0.5.21", "0.5.15.post1", "0.5.23"])
def test_the_flag_picks_the_releases_layout(version):
    assert server_config(["--sglang-version", version]).sglang.layout == layout_for(version)


def test_the_environment_variable_picks_it_too(monkeypatch):
    monkeypatch.setenv("ENCODER_SGLANG_VERSION", "0.5.20")
    layout = server_config([]).sglang.layout
    assert layout.modality == ("sglang.srt.managers.schedule_batch", "Modality")
    assert layout.embedding_data == ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")


@pytest.mark.parametrize("environment", [False, True])
def test_an_unknown_release_fails_start_up_listing_the_known_ones(monkeypatch, capsys, environment):
    argv = [] if environment else ["--sglang-version", "0.5.9"]
    if environment:
        monkeypatch.setenv("ENCODER_SGLANG_VERSION", "0.5.9")
    with pytest.raises(SystemExit) as exited:
        server_config(argv)
    assert exited.value.code == 2
    assert (
        "argument --sglang-version: no EmbeddingData layout for SGLang 0.5.9: known are 0.5.13 to 0.5.23"
        in capsys.readouterr().err
    )


def test_a_config_built_in_code_is_checked_as_well():
    with pytest.raises(ValueError, match="no EmbeddingData layout for SGLang 0.6.0: known are 0.5.13 to 0.5.23"):
        SglangConfig(version="0.6.0")


@functools.cache
def release_sources(version: str) -> dict[str, str]:
    """The files testkit/sglang_releases.py reads, from the release's wheel (downloaded once)."""
    return read_sources(release_wheel(version))


@pytest.mark.engine
@pytest.mark.parametrize("version", [NEWEST, MIDDLE, "0.5.19", OLDEST])
def test_the_pickle_written_for_a_release_is_accepted_by_its_own_unpickler(version):
    assert check_release(release_sources(version), SglangConfig(version=version).layout) == []


@pytest.mark.engine
@pytest.mark.parametrize(
    ("written_for", "read_by"),
    [(NEWEST, MIDDLE), (NEWEST, OLDEST), (MIDDLE, OLDEST), (OLDEST, MIDDLE), (OLDEST, NEWEST)],
)
def test_a_release_of_another_layout_refuses_it(written_for, read_by):
    problems = check_release(release_sources(read_by), SglangConfig(version=written_for).layout)
    refused = [problem for problem in problems if problem.startswith(("refused", "rebuilt without"))]
    assert len(refused) == 2, problems  # the embedding's pickle and the error's


@pytest.mark.engine
def test_the_newest_release_also_reads_the_middle_layout():
    """0.5.23 moved Modality but still admits it at its old path (schedule_batch re-exports it)."""
    assert check_release(release_sources(NEWEST), layout_for(MIDDLE)) == []
