"""OpenTelemetry tracing for the gateway, the receiver and the encoder server (the `tracing` extra):
configuration from a flag and the standard OTEL_* variables, export over OTLP/HTTP or OTLP/gRPC, spans
that are one shared no-op while tracing is off, and the W3C trace context carried in gRPC metadata and
HTTP headers. Nothing imports opentelemetry until `configure` (or `use_host_provider`) turns it on."""

from __future__ import annotations

import argparse
import contextvars
import functools
import importlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Self

import grpc

log = logging.getLogger(__name__)

# Where OTLP traces go when no flag says: the exporter's own variables, most specific first.
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
# The OTLP exporter module of each protocol (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL's values).
EXPORTERS = {
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
}
INSTRUMENTATION = "encoder-service"

# Span kinds by name, resolved to opentelemetry's SpanKind once tracing is on.
SERVER, CLIENT, INTERNAL = "SERVER", "CLIENT", "INTERNAL"
# gRPC codes a server span counts as errors (OpenTelemetry's RPC conventions); a client span counts every
# code but OK.
_SERVER_ERRORS = frozenset(
    code.value[0]
    for code in (
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    )
)


class _NoSpan:
    """What `span` gives while tracing is off: a context manager and a span that record nothing."""

    __slots__ = ()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def is_recording(self) -> bool:
        return False


NO_SPAN = _NoSpan()

# The on state: set by `configure` / `use_host_provider`, cleared by `shutdown`.
_tracer: Any = None
_provider: Any = None  # the provider `configure` made (None: tracing off, or the host process's)
_otel: Any = None  # the opentelemetry names used per span, bound once (_OtelNames)


class _OtelNames:
    """The opentelemetry functions and types the spans use, imported when tracing turns on."""

    def __init__(self) -> None:
        from opentelemetry import propagate, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self.trace = trace
        self.propagate = propagate
        self.kinds = {SERVER: SpanKind.SERVER, CLIENT: SpanKind.CLIENT, INTERNAL: SpanKind.INTERNAL}
        self.Status = Status
        self.ERROR = StatusCode.ERROR


def add_flag(parser: argparse.ArgumentParser) -> None:
    """The `--otlp-traces-endpoint` option every command has."""
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="export traces over OTLP to this collector (http://collector:4318/v1/traces; the tracing extra); "
        "unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing; "
        "the other settings are the OTEL_* variables (docs/tracing.md)",
    )


def configure_from_args(args: argparse.Namespace, service_name: str) -> bool:
    """`configure` with the command's `--otlp-traces-endpoint`; exits with one line on stderr when that
    flag asks for tracing and the extra is missing or the settings are refused."""
    flag = getattr(args, "otlp_traces_endpoint", None)
    try:
        return configure(service_name, flag)
    except (ImportError, ValueError) as exc:
        raise SystemExit(f"{service_name}: {exc}") from None


def configure(service_name: str, endpoint: str | None = None) -> bool:
    """Turns tracing on for this process when `endpoint` or an OTEL endpoint variable names a collector,
    and OTEL_SDK_DISABLED / OTEL_TRACES_EXPORTER do not turn it off. Spans go through a batching
    processor to an OTLP exporter: over HTTP (`http/protobuf`, OpenTelemetry's default; `endpoint` is then
    the whole URL, e.g. http://collector:4318/v1/traces) or over gRPC (`grpc`) as the OTEL protocol
    variables say. The sampler is the SDK's (OTEL_TRACES_SAMPLER, default: the parent's decision, else
    always); the service name `service_name` unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES name one.
    Returns whether tracing is on.

    HTTP is the default because gRPC's exporter is a synchronous gRPC client: its first call starts gRPC's
    own I/O threads in the process, which from then on carry the process's grpc.aio traffic too (their
    CPU time grows with the bytes the encoder streams move; docs/tracing.md).

    Raises ImportError (naming the extra) when `endpoint` was given and opentelemetry is not installed; an
    endpoint from the environment alone then only logs a warning, since a cluster may set it for every pod.
    Raises ValueError for an exporter other than OTLP or a protocol other than these two.
    """
    global _tracer, _provider, _otel
    asked = endpoint is not None
    if not (endpoint or any(os.environ.get(v) for v in ENDPOINT_VARIABLES)):
        return False
    if _env_flag("OTEL_SDK_DISABLED") or os.environ.get("OTEL_TRACES_EXPORTER") == "none":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "otlp")
    if exporter != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={exporter!r}: only 'otlp' (or 'none') is supported")
    protocol = next((os.environ[v] for v in PROTOCOL_VARIABLES if os.environ.get(v)), "http/protobuf")
    if protocol not in EXPORTERS:
        raise ValueError(
            f"OTLP protocol {protocol!r}: traces are exported over {' or '.join(map(repr, EXPORTERS))}"
        )
    try:
        exporter_class = importlib.import_module(EXPORTERS[protocol]).OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        message = (
            f"tracing needs the tracing extra ({exc.name} is missing): pip install 'encoder-service[tracing]'"
        )
        if not asked:
            log.warning("%s; running without tracing", message)
            return False
        raise ImportError(message) from None
    shutdown()
    resource = Resource.create()  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service_name}))
    provider = TracerProvider(resource=resource)
    # endpoint=None: the exporter reads the OTEL endpoint variables itself, by the specification's rules.
    provider.add_span_processor(BatchSpanProcessor(exporter_class(endpoint=endpoint)))
    _otel, _provider = _OtelNames(), provider
    _tracer = provider.get_tracer(INSTRUMENTATION)
    where = endpoint or next(os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v))
    log.info("tracing: OTLP %s to %s as %s", protocol, where, resource.attributes.get("service.name"))
    return True


def use_host_provider() -> None:
    """Turns tracing on with the tracer provider the host process set up (vLLM's, for the connector
    it loads), whose exporter and sampler then apply."""
    global _tracer, _otel
    _otel = _OtelNames()
    _tracer = _otel.trace.get_tracer(INSTRUMENTATION)


def shutdown() -> None:
    """Exports what is left and turns tracing off (the process's own provider only)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def span(
    name: str,
    *,
    kind: str = INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    parent: Any = None,
):
    """A context manager giving a span that is current inside it (a child of the current one, or of
    `parent`, a context from `context_from`); the shared no-op while tracing is off."""
    if _tracer is None:
        return NO_SPAN
    return _tracer.start_as_current_span(name, context=parent, kind=_otel.kinds[kind], attributes=attributes)


def interval(name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None) -> None:
    """A span of the current one, for something timed elsewhere (on another thread): from `start_ns` to
    `end_ns` (time.time_ns())."""
    if _tracer is not None:
        _tracer.start_span(name, start_time=start_ns, attributes=attributes).end(end_time=end_ns)


def event(name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """An event on the current span."""
    if _tracer is not None:
        _otel.trace.get_current_span().add_event(name, attributes)


def failed(span: Any, message: str) -> None:
    """Marks `span` as failed with `message` (a span that ended in an error no exception carried out)."""
    if span.is_recording():
        span.set_status(_otel.Status(_otel.ERROR, message))


def in_context(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` running in the caller's context (its current span) wherever it is called: for work
    handed to a thread pool, which does not carry it. `function` itself while tracing is off."""
    if _tracer is None:
        return function
    return functools.partial(contextvars.copy_context().run, function)


def now_ns() -> int:
    return time.time_ns()


# ---- the trace context in gRPC metadata and HTTP headers ----


def grpc_metadata(metadata: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
    """`metadata` with the current trace context added (traceparent, tracestate) while tracing is on."""
    if _tracer is None:
        return metadata
    carrier: dict[str, str] = {}
    _otel.propagate.inject(carrier)
    return (*metadata, *carrier.items())


def http_headers() -> dict[str, str] | None:
    """The current trace context as HTTP headers (traceparent, tracestate); None while tracing is off."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    _otel.propagate.inject(carrier)
    return carrier


def context_from(carrier: Mapping[str, str] | Iterable[tuple[str, Any]] | None) -> Any:
    """The trace context an incoming call carries (HTTP headers, gRPC invocation metadata or vLLM's
    `trace_headers`); None while tracing is off or when it carries none."""
    if _tracer is None or not carrier:
        return None
    if not isinstance(carrier, Mapping):
        carrier = {key: value for key, value in carrier if isinstance(value, str)}
    return _otel.propagate.extract(carrier)


def rpc_attributes(full_method: str) -> dict[str, str]:
    """OpenTelemetry's RPC attributes of a gRPC method, `/package.Service/Method`."""
    service, _, method = full_method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def client_span(full_method: str, url: str, attributes: Mapping[str, Any] | None = None):
    """`span` for a call of `full_method` (`/package.Service/Method`) to the server at `url`
    (`grpc://host:port`), with OpenTelemetry's RPC and server attributes."""
    if _tracer is None:
        return NO_SPAN
    host, _, port = url.partition("://")[2].lstrip("/").rpartition(":")
    rpc = {**rpc_attributes(full_method), "server.address": host, "encoder.url": url, **(attributes or {})}
    if port.isdigit():
        rpc["server.port"] = int(port)
    return span(full_method.lstrip("/"), kind=CLIENT, attributes=rpc)


def rpc_ended(span: Any, code: grpc.StatusCode | None, message: str = "", *, server: bool = False) -> None:
    """Records how a call ended on its span: its status code (None: a stream that broke the contract,
    which fails the span without one)."""
    if not span.is_recording():
        return
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is None or (code is not grpc.StatusCode.OK and (not server or code.value[0] in _SERVER_ERRORS)):
        failed(span, message or (code.name if code is not None else "broken stream"))


def server_interceptors(services: Sequence[str]) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor giving every call of `services` (full service names) a server span joined to
    the caller's trace context; none while tracing is off, so untraced servers run no extra code."""
    return [] if _tracer is None else [_TracingInterceptor(services)]


class _TracingInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span around each unary-request call of the chosen services, current while the handler
    runs (its tasks inherit it), with the caller's trace context as parent and the call's status code."""

    def __init__(self, services: Sequence[str]):
        self.prefixes = tuple(f"/{service}/" for service in services)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or not details.method.startswith(self.prefixes):
            return handler
        name = details.method[1:]
        attributes = rpc_attributes(details.method)
        if handler.response_streaming:
            return handler._replace(unary_stream=_traced(handler.unary_stream, name, attributes))
        return handler._replace(unary_unary=_traced(handler.unary_unary, name, attributes))


def _traced(behavior: Callable, name: str, attributes: dict[str, str]) -> Callable:
    async def traced(request, context: grpc.aio.ServicerContext):
        parent = context_from(context.invocation_metadata())
        # The status comes from the call's code: the AbortError a refusal raises is no exception of the span's.
        with _tracer.start_as_current_span(
            name,
            context=parent,
            kind=_otel.kinds[SERVER],
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as current:
            current.set_attribute("network.peer.address", context.peer())
            try:
                return await behavior(request, context)
            finally:
                rpc_ended(current, context.code() or grpc.StatusCode.OK, context.details() or "", server=True)

    return traced


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"
