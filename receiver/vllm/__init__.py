"""The vLLM encoder-cache connector (vLLM loads it; `import receiver` does not) and its scheduler-side fetches."""
