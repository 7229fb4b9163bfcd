"""SGLang's encoder gRPC contract (`sglang.grpc.encoder.SglangEncoder`), served beside encoder.v1 so
that an unchanged SGLang prefill node can use these encoder servers; see docs/sglang.md."""
