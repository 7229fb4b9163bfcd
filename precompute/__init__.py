"""encoder-precompute, the offline tool: images encoded ahead of time into one safetensors file per image
content hash, which EncoderReceiver accepts as precomputed items. One output directory holds one model's
embeddings: a rerun skips images whose file exists and refuses files of another model. The encoder
server does not import this package."""
