"""The encoder service contract: the .proto, its generated code, the chunk codec (`wire`) and the
shared-memory segment contract (`shm`) both sides share."""
