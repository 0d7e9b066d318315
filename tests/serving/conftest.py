"""The serving tests' ``engine``, ``server`` and ``client`` fixtures: one definition each, in tests/fixtures.py.

A test module gives its checkpoint as a module-scoped ``served`` fixture (the arguments of ``Engine.from_pretrained``:
``path``, ``name``, ...), its server's limits as ``SERVER`` (``ServerConfig`` fields; the port is free and the key
is ``fixtures.API_KEY``) and, if not 60 s, its client's timeout as ``CLIENT_TIMEOUT``.
"""

from fixtures import client, engine, server  # noqa: F401
