"""`encoder-gateway`: an OpenAI-compatible front for an inference engine (vLLM) that encodes each request's
images on the encoder pods and hands the engine their embeddings instead of the pictures.

Not imported by `receiver`: a prefill node that only uses the Python API does not pull in the HTTP stack.
"""
