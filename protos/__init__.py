"""The encoder service contract: the .proto, its generated code, and the codec both sides share."""
