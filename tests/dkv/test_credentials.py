"""Tenant credentials: the tenants file, namespace grants, the local credential of a tokenless node."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dkv.credentials import CLUSTER, Credential, Credentials, LocalCredential, load_tenants, read_local_credential
from dkv.errors import ConfigError


def test_a_tenants_file_is_read_with_grants_access_and_quotas(tmp_path: Path) -> None:
    (tmp_path / "beta.secret").write_text("beta-secret-0123456789\n")
    path = tmp_path / "tenants.toml"
    path.write_text('''
[tenants.acme]
secret = "acme-secret-0123456789"
namespaces = ["acme/*"]
max_stored_bytes = "1GiB"
max_leases = 100

[tenants.beta]
secret_file = "beta.secret"
namespaces = ["beta/*", "shared/docs"]
access = "read"
''')
    tenants = load_tenants(path)
    acme, beta = tenants["acme"], tenants["beta"]
    assert acme.secret == b"acme-secret-0123456789" and beta.secret == b"beta-secret-0123456789"
    assert acme.can_write and not beta.can_write
    assert acme.quotas.max_stored_bytes == 2**30 and acme.quotas.max_leases == 100
    assert acme.allows("acme/m1") and not acme.allows("beta/m1") and not acme.allows("acme")
    assert beta.allows("shared/docs") and not beta.allows("shared/other")
    table = Credentials(Credential(CLUSTER, b"cluster-token-0123456789"), tenants)
    assert table.get(None) is table.cluster and table.get("acme") is acme and table.get("ghost") is None


@pytest.mark.parametrize("body, complaint", [
    ("", "no \\[tenants.NAME\\]"),
    ('[tenants.a]\nsecret = "short"\nnamespaces = ["a/*"]', "too short"),
    ('[tenants.a]\nsecret = "long-enough-secret-0"\nnamespaces = []', "namespaces"),
    ('[tenants.a]\nsecret = "long-enough-secret-0"\nnamespaces = ["a/*"]\naccess = "admin"', "access"),
    ('[tenants.a]\nsecret = "long-enough-secret-0"\nnamespaces = ["a/*"]\nmax_leases = -1', "non-negative"),
    ('[tenants.a]\nsecret = "long-enough-secret-0"\nnamespaces = ["a/*"]\ncolour = 1', "unknown field"),
    ('[tenants.a]\nnamespaces = ["a/*"]', "exactly one of secret"),
    ('[tenants."bad name"]\nsecret = "long-enough-secret-0"\nnamespaces = ["a/*"]', "tenant names"),
    ("not toml [", "not valid TOML"),
])
def test_a_bad_tenants_file_is_a_config_error_naming_the_problem(tmp_path: Path, body: str, complaint: str) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=complaint):
        load_tenants(path)


def test_the_local_credential_is_readable_by_its_user_only_and_removed_at_close() -> None:
    local = LocalCredential("unit")
    try:
        assert os.stat(local.path).st_mode & 0o777 == 0o600
        assert read_local_credential(local.path) == local.secret
        assert read_local_credential("/etc/passwd") is None, "only a dKV credential file is read"
    finally:
        local.close()
    assert not os.path.exists(local.path)
    assert read_local_credential(local.path) is None
