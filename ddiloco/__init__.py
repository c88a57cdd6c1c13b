"""ddiloco: Decoupled DiLoCo pre-training across regions."""

__version__ = "0.1.0"
