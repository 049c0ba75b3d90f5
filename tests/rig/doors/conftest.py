"""The doors' rig tests share the proxy fixture of the unit tests (one definition)."""

from tests.unit.doors.test_proxy import proxy_for  # noqa: F401  (a fixture: pytest finds it by name)
