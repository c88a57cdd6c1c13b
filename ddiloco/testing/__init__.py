"""Test and benchmark support: scratch PostgreSQL databases, moto's S3 server, free ports, waits,
and a run's processes started the way the flows start them.

Tests, benchmarks and the chaos suite import it; the runtime never does. ``ddiloco.testing.s3``
needs the ``test`` extra (moto)."""
