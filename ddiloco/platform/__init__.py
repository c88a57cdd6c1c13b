"""Shared building blocks: config, ledger, fragment store, fragments, compression, models, data."""
