"""Session fixtures: the built-in default model written once, on disk, in the real format."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.default_model import write_default_model


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    """The built-in default model (Qwen2.5-VL architecture, random weights), as the demo uses it."""
    return write_default_model(tmp_path_factory.mktemp("default-model"))
