"""What a request gets back: item results and their assembly into tensors, precomputed items, the receiver's cache, chunked-prefill windows."""
