"""The vLLM releases the connector runs on, checked against the installed vLLM's own classes: it imports on
any version, accepts a version string inside `encoder_common.vllm_releases.SUPPORTED_VLLM`, and refuses one
outside it, or an interface lacking a method or with a changed signature, when vLLM starts it: naming the
version and what is missing, never as an ImportError. The gateway refuses to start in front of a vLLM
reporting a release outside the range."""

from __future__ import annotations

import json
import subprocess

import pytest
from aiohttp import web

from encoder_common.vllm_releases import SUPPORTED_VLLM, in_supported_range, release
from gateway.app import start
from gateway.config import GatewayConfig
from testkit.servers import running_server
from testkit.vllm_server import ENGINES_PYTHON, connector_transfer_config, engines_env, launch_vllm

INSIDE = ["0.31.0", "0.32.0", "0.33.0", "0.33.2+cpu"]
OUTSIDE = ["0.30.0", "0.34.0", "1.0.0", "unknown"]

# Run in the engines' venv: the version string replaced before the connector is imported, then the check
# vLLM runs when it creates the connector; one line of JSON per case.
CHECK_SCRIPT = """
import json, sys
import vllm
from vllm.distributed.ec_transfer.ec_connector import base

def check():
    from receiver.vllm import connector as vllm_connector, contract as vllm_contract
    try:
        vllm_contract.check_vllm_contract(vllm_connector.EncoderServiceConnector)
        return None
    except vllm_contract.VllmContractError as exc:
        return str(exc)

for version in sys.argv[1:]:
    vllm.__version__ = version
    print(json.dumps({"case": version, "error": check()}))
vllm.__version__ = "0.32.0"
del base.ECConnectorBase.take_unavailable_requests
def update_state_after_alloc(self, request, index, extra): ...
base.ECConnectorBase.update_state_after_alloc = update_state_after_alloc
print(json.dumps({"case": "changed interface", "error": check()}))
"""


def test_version_strings_parse_and_fall_inside_or_outside_the_range():
    assert release("0.33.1+cpu") == (0, 33, 1)
    assert release("0.34.0rc1") == (0, 34, 0)
    assert release("dev") is None
    assert all(in_supported_range(v) for v in INSIDE)
    assert not any(in_supported_range(v) for v in OUTSIDE)


@pytest.fixture(scope="module")
def checks() -> dict[str, str | None]:
    """The connector's start-up check against the installed vLLM, per faked version string, then against that
    vLLM with one connector method removed and another's signature changed."""
    run = subprocess.run(
        [str(ENGINES_PYTHON), "-c", CHECK_SCRIPT, *INSIDE, *OUTSIDE],
        env=engines_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {line["case"]: line["error"] for line in lines}



@pytest.mark.engine
def test_the_installed_vllm_api_passes_under_every_version_string_inside_the_range(checks):
    assert {version: checks[version] for version in INSIDE} == dict.fromkeys(INSIDE)


@pytest.mark.engine
@pytest.mark.parametrize("version", OUTSIDE)
def test_a_version_outside_the_range_is_refused_naming_it_and_the_range(checks, version):
    error = checks[version]
    assert error is not None
    assert f"cannot run on vLLM {version}: it is outside the supported range {SUPPORTED_VLLM}" in error


@pytest.mark.engine
def test_an_interface_lacking_a_method_or_changing_a_signature_is_refused_naming_both(checks):
    error = checks["changed interface"]
    assert error is not None and "cannot run on vLLM 0.32.0: it lacks " in error
    assert "ECConnectorBase.take_unavailable_requests" in error
    assert "ECConnectorBase.update_state_after_alloc(self, request, index)" in error
    assert "(this vLLM has update_state_after_alloc(self, request, index, extra))" in error


@pytest.mark.engine
def test_vllm_with_the_connector_fails_at_start_up_outside_the_range(default_model_dir, tmp_path):
    """A real vLLM server start with the connector, its version string set to the next minor release in
    every process it starts (a sitecustomize): the engine does not come up, and its log carries the
    connector's message instead of an ImportError."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import vllm\nvllm.__version__ = '0.34.0'\n")
    env = {"PYTHONPATH": f"{site}:{engines_env()['PYTHONPATH']}"}
    log_path = tmp_path / "vllm.log"
    with pytest.raises(RuntimeError, match="vLLM did not start"):
        with launch_vllm(
            default_model_dir,
            log_path=log_path,
            extra_args=["--ec-transfer-config", connector_transfer_config(["grpc://127.0.0.1:9"])],
            extra_env=env,
            timeout=600,
        ):
            pass
    log = log_path.read_text(errors="replace")
    refusal = f"cannot run on vLLM 0.34.0: it is outside the supported range {SUPPORTED_VLLM}"
    assert f"VllmContractError: EncoderServiceConnector {refusal}" in log
    assert "ImportError" not in log


@pytest.fixture
async def engine_reporting():
    """An HTTP server answering `/version` as vLLM's does, with the release the test sets."""
    reported = {"version": None}

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": reported["version"]})

    app = web.Application()
    app.router.add_get("/version", version)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield reported, f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0", "0.34.0", "0.30.2"])
async def test_the_gateway_starts_only_in_front_of_a_vllm_in_the_range(
    default_model_dir, engine_reporting, version
):
    reported, engine_url = engine_reporting
    reported["version"] = version
    async with running_server(default_model_dir) as encoder:
        config = GatewayConfig(engine_url=engine_url, encoders=(encoder.url,), host="127.0.0.1", port=0)
        if in_supported_range(version):
            runner, _ = await start(config)
            await runner.cleanup()
            return
        refusal = rf"the engine at {engine_url} is vLLM {version}, outside the releases"
        with pytest.raises(ValueError, match=refusal):
            await start(config)
