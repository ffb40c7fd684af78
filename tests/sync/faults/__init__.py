"""Fault-injection tests of graft's sync and delivery checks."""
