"""The SGLang EmbeddingData layouts by release: each release maps to one layout, and the installed SGLang's
own SafeUnpickler source (run by testkit/sglang_releases.py) accepts its layout's pickles and refuses
another release's; scripts/check_sglang_releases.py runs the same check on every release's wheel."""

from __future__ import annotations

import pytest

from encoder_server.sglang.embedding_data import LAYOUTS, SGLANG_VERSION, layout_for
from testkit import REPO_ROOT
from testkit.sglang_releases import check_release, read_sources


@pytest.mark.parametrize(
    ("version", "module", "modality"),
    [
        ("0.5.23", "sglang.srt.disaggregation.encoder.receiver", "sglang.srt.multimodal.modality"),
        ("0.5.20", "sglang.srt.disaggregation.encoder.receiver", "sglang.srt.managers.schedule_batch"),
        ("0.5.15.post1", "sglang.srt.disaggregation.encode_receiver", "sglang.srt.managers.schedule_batch"),
    ],
)
def test_each_release_gets_the_layout_read_in_its_wheel(version, module, modality):
    layout = layout_for(version)
    assert layout.embedding_data == (module, "EmbeddingData")
    assert layout.modality == (modality, "Modality")


@pytest.mark.parametrize("version", ["0.5.12", "0.5.24", "main"])
def test_a_release_outside_the_table_is_refused_naming_it(version):
    with pytest.raises(ValueError, match=f"no EmbeddingData layout for SGLang {version}: known are 0.5.13 to 0.5.23"):
        layout_for(version)


@pytest.fixture(scope="module")
def installed_sources() -> dict[str, str]:
    site_packages = sorted((REPO_ROOT / ".venv-engines" / "lib").glob("python3*/site-packages"))
    if not site_packages:
        pytest.fail(".venv-engines is missing: run ./scripts/setup_engines.sh (scripts/test.sh does)")
    return read_sources(site_packages[0])


@pytest.mark.engine
def test_the_installed_sglangs_own_unpickler_accepts_its_layout_and_refuses_an_older_one(installed_sources):
    assert check_release(installed_sources, layout_for(SGLANG_VERSION)) == []
    older = LAYOUTS[-1]  # 0.5.13-0.5.18: another module path and attribute
    problems = check_release(installed_sources, older)
    assert any("encode_receiver" in problem for problem in problems)
    assert any("refused: Blocked unsafe global (sglang.srt.disaggregation.encode_receiver" in p for p in problems)
