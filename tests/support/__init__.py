"""Helpers the tests share: stand-ins for kernel libraries, report writers (no tests here)."""
