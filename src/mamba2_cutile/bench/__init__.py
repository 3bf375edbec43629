"""Benchmark harness: timing, roofline formulas and the implementations compared."""
