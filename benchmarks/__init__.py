"""Benchmarks and harnesses of the checkout (not shipped with the package); see README.md."""
