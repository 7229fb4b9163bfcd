"""Tooling for the tests, the benchmarks and the demo (never installed): tiny real checkpoints, real
images, encoder doubles, and encoder servers on loopback, in-process or as child processes."""
