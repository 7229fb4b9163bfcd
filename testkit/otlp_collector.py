"""A real OTLP trace endpoint on 127.0.0.1, as the OpenTelemetry collector serves one (opentelemetry-proto):
`TraceService.Export` over gRPC and `POST /v1/traces` over HTTP, keeping every span the exporters send,
for the tracing tests, the benchmark and the docs' trace picture.

    with OtlpCollector() as collector:     # in-process, on threads of its own
        collector.endpoint                 # OTLP/HTTP: http://127.0.0.1:<port>/v1/traces
        collector.grpc_endpoint            # OTLP/gRPC: http://127.0.0.1:<port>
        spans = collector.wait_for(lambda spans: ..., timeout=30)

`python -m testkit.otlp_collector [--save spans.json]` runs it as a process (`ready on 127.0.0.1:<port>`,
the HTTP port; the gRPC one follows as `grpc on 127.0.0.1:<port>`), writing what it received as JSON when
stopped by SIGTERM.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2

_KINDS = {
    trace_pb2.Span.SPAN_KIND_SERVER: "SERVER",
    trace_pb2.Span.SPAN_KIND_CLIENT: "CLIENT",
    trace_pb2.Span.SPAN_KIND_INTERNAL: "INTERNAL",
    trace_pb2.Span.SPAN_KIND_UNSPECIFIED: "INTERNAL",
    trace_pb2.Span.SPAN_KIND_PRODUCER: "PRODUCER",
    trace_pb2.Span.SPAN_KIND_CONSUMER: "CONSUMER",
}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass(frozen=True)
class ExportedSpan:
    """One span as an exporter sent it, ids in hex."""

    service: str  # the resource's service.name
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL, ...
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]  # (name, time_ns, attributes)
    status: str  # UNSET, OK, ERROR
    resource: dict[str, Any]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return None if kind is None else getattr(value, kind)


def _attributes(pairs) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ExportedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ExportedSpan(
                        service=str(resource.get("service.name", "")),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=_KINDS[span.kind],
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        events=[(e.name, e.time_unix_nano, _attributes(e.attributes)) for e in span.events],
                        status=_STATUS[span.status.code],
                        resource=resource,
                    )
                )
    return spans


class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span, whichever transport brought it; `wait_for` polls them until a condition
    holds."""

    def __init__(self) -> None:
        self._spans: list[ExportedSpan] = []
        self._lock = threading.Lock()
        self.exports = {"grpc": 0, "http": 0}  # export requests answered, by transport
        self._server = grpc.server(ThreadPoolExecutor(2, thread_name_prefix="otlp-collector"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.grpc_port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_HttpExport, self))
        self.port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="otlp-collector-http", daemon=True).start()

    @property
    def endpoint(self) -> str:
        """The OTLP/HTTP endpoint (the tracing extra's default protocol)."""
        return f"http://127.0.0.1:{self.port}/v1/traces"

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    def Export(self, request, context):
        self.received(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()

    def received(self, request: trace_service_pb2.ExportTraceServiceRequest, transport: str) -> None:
        spans = spans_of(request)
        with self._lock:
            self._spans.extend(spans)
            self.exports[transport] += 1

    @property
    def spans(self) -> list[ExportedSpan]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ExportedSpan]:
        return [span for span in self.spans if span.trace_id == trace_id]

    def wait_for(
        self, condition: Callable[[list[ExportedSpan]], bool], timeout: float = 30.0
    ) -> list[ExportedSpan]:
        """The spans once `condition(spans)` holds; AssertionError naming what arrived after `timeout`."""
        deadline = time.monotonic() + timeout
        while not condition(spans := self.spans):
            if time.monotonic() > deadline:
                names = sorted({(span.service, span.name) for span in spans})
                raise AssertionError(
                    f"the spans exported in {timeout:g} s do not hold the condition: {names}"
                )
            time.sleep(0.05)
        return spans

    def save(self, path: Path) -> None:
        path.write_text(json.dumps([asdict(span) for span in self.spans], indent=1))

    def stop(self) -> None:
        self._server.stop(grace=None)
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class _HttpExport(BaseHTTPRequestHandler):
    """OTLP/HTTP: `POST /v1/traces` with an ExportTraceServiceRequest in binary protobuf (gzip allowed)."""

    def __init__(self, collector: OtlpCollector, *args) -> None:
        self.collector = collector
        super().__init__(*args)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
            self.send_error(404 if self.path != "/v1/traces" else 415)
            return
        self.collector.received(trace_service_pb2.ExportTraceServiceRequest.FromString(body), "http")
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args) -> None:
        pass  # one line per export would drown a test's output


def tree_root(spans: list[ExportedSpan], parent_id: str = "") -> ExportedSpan:
    """The root of `spans`, checked to be one trace whose parent links form one tree under a span whose
    parent is `parent_id` (a caller's span outside the trace's exporters, or "" for none)."""
    assert len({span.trace_id for span in spans}) == 1, "more than one trace id"
    ids = {span.span_id for span in spans}
    assert len(ids) == len(spans), "a span id appears twice"
    roots = [span for span in spans if span.parent_id not in ids]
    assert len(roots) == 1 and roots[0].parent_id == parent_id, [(r.name, r.parent_id) for r in roots]
    return roots[0]


def children(spans: list[ExportedSpan], parent: ExportedSpan, name: str | None = None) -> list[ExportedSpan]:
    """The spans whose parent is `parent` (named `name` if given), by start time."""
    found = [s for s in spans if s.parent_id == parent.span_id and (name is None or s.name == name)]
    return sorted(found, key=lambda span: span.start_ns)


def load(path: Path) -> list[ExportedSpan]:
    """Spans written by `OtlpCollector.save`."""
    return [
        ExportedSpan(**{**span, "events": [tuple(e) for e in span["events"]]})
        for span in json.loads(path.read_text())
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="an OTLP/gRPC trace endpoint that keeps what it receives")
    parser.add_argument("--save", type=Path, help="write the spans here as JSON on SIGTERM")
    args = parser.parse_args()
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    with OtlpCollector() as collector:
        print(f"ready on 127.0.0.1:{collector.port}\ngrpc on 127.0.0.1:{collector.grpc_port}", flush=True)
        stopped.wait()
        if args.save:
            collector.save(args.save)
