"""The package version, one place: read by the CLI, fingerprints and exports."""

__version__ = "0.1.0"
