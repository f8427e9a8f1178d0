"""Real stand-ins for outside services, shared by the tests and the benchmarks."""
