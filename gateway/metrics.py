"""The gateway's Prometheus metrics (`/metrics`): its requests, the images it encoded and how long encode
and hand-off took, plus the receiver's own counters; named like the encoder server's (`encoder_gateway_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from receiver.metrics import ReceiverMetrics

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self, receiver_metrics: ReceiverMetrics):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "encoder_gateway_requests",
            "Chat requests finished, by outcome and HTTP status",
            ["outcome", "status"],
            registry=r,
        )
        self.in_flight = Gauge("encoder_gateway_requests_in_flight", "Chat requests being served", registry=r)
        self.images = Counter(
            "encoder_gateway_images", "Image parts encoded and replaced by embeddings", registry=r
        )
        self.encode_failures = Counter(
            "encoder_gateway_encode_failures",
            "Requests whose images could not be encoded, by HTTP status",
            ["status"],
            registry=r,
        )
        self.encode_seconds = Histogram(
            "encoder_gateway_encode_seconds",
            "Fetching and encoding one request's images",
            buckets=_SECONDS,
            registry=r,
        )
        self.handoff_seconds = Histogram(
            "encoder_gateway_handoff_seconds",
            "Turning one request's embeddings into engine input",
            buckets=_SECONDS,
            registry=r,
        )
        self.engine_seconds = Histogram(
            "encoder_gateway_engine_seconds",
            "From forwarding a request to the engine's last byte",
            buckets=_SECONDS,
            registry=r,
        )
        r.register(receiver_metrics.prometheus_collector())

    def encoded(self, images: int, encode_s: float, handoff_s: float) -> None:
        self.images.inc(images)
        self.encode_seconds.observe(encode_s)
        self.handoff_seconds.observe(handoff_s)

    def encode_failed(self, status: int) -> None:
        self.encode_failures.labels(str(status)).inc()

    def finished(self, outcome: str, status: int) -> None:
        self.requests.labels(outcome, str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
