"""A real OpenLDAP server for the tests: Debian's slapd with a generated config
(slapd.conf, an mdb database in a temporary directory) on a free loopback port,
seeded with ldapadd and changed with ldapmodify/ldapdelete, stopped afterwards.

The seeded university: people under ou=people (posixAccount + inetOrgPerson),
groups under ou=groups: posixGroups (memberUid) and a groupOfNames (member DN).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import ldap

from tests.e2e.conftest import free_port, wait_until

SLAPD = "/usr/sbin/slapd"
SUFFIX = "dc=uni,dc=example"
ADMIN_DN = f"cn=admin,{SUFFIX}"
ADMIN_PASSWORD = "admin-secret"
# The service account gpulab searches with (read-only by the default ACL).
SERVICE_DN = f"cn=gpulab,ou=services,{SUFFIX}"
SERVICE_PASSWORD = "gpulab-secret"
PEOPLE = f"ou=people,{SUFFIX}"
GROUPS = f"ou=groups,{SUFFIX}"


def person(uid: str, number: int, gid: int, password: str, given: str) -> str:
    return textwrap.dedent(f"""\
        dn: uid={uid},{PEOPLE}
        objectClass: inetOrgPerson
        objectClass: posixAccount
        uid: {uid}
        cn: {given} Tester
        givenName: {given}
        sn: Tester
        mail: {uid}@uni.example
        uidNumber: {number}
        gidNumber: {gid}
        homeDirectory: /home/{uid}
        loginShell: /bin/bash
        userPassword: {password}
        """)


def posix_group(cn: str, gid: int, *members: str) -> str:
    lines = [
        f"dn: cn={cn},{GROUPS}",
        "objectClass: posixGroup",
        f"cn: {cn}",
        f"gidNumber: {gid}",
        *(f"memberUid: {m}" for m in members),
    ]
    return "\n".join(lines) + "\n"


def names_group(cn: str, *member_uids: str) -> str:
    lines = [
        f"dn: cn={cn},{GROUPS}",
        "objectClass: groupOfNames",
        f"cn: {cn}",
        *(f"member: uid={m},{PEOPLE}" for m in member_uids),
    ]
    return "\n".join(lines) + "\n"


SEED = "\n".join(
    [
        textwrap.dedent(f"""\
            dn: {SUFFIX}
            objectClass: dcObject
            objectClass: organization
            dc: uni
            o: Example University

            dn: ou=people,{SUFFIX}
            objectClass: organizationalUnit
            ou: people

            dn: ou=groups,{SUFFIX}
            objectClass: organizationalUnit
            ou: groups

            dn: ou=services,{SUFFIX}
            objectClass: organizationalUnit
            ou: services

            dn: {SERVICE_DN}
            objectClass: organizationalRole
            objectClass: simpleSecurityObject
            cn: gpulab
            userPassword: {SERVICE_PASSWORD}
            """),
        # dora: only in the directory (uid 20001 is in no /etc/passwd here).
        person("dora", 20001, 20001, "dora-pw-1", "Dora"),
        person("ezra", 20002, 20002, "ezra-pw-1", "Ezra"),
        person("fay", 20003, 20003, "fay-pw-1", "Fay"),
        posix_group("dora", 20001, "dora"),
        posix_group("vision-lab", 5000, "dora", "fay"),
        posix_group("nlp-lab", 5001, "ezra"),
        posix_group("gpulab-admins", 5002, "fay"),
        names_group("vision-pis", "dora"),
    ]
)


@dataclass
class Slapd:
    """A running slapd: its URI, and ldap-utils commands against it as admin."""

    uri: str
    root: Path
    popen: subprocess.Popen[bytes]

    def _tool(self, tool: str, ldif: str = "", *args: str) -> None:
        subprocess.run(
            [tool, "-x", "-H", self.uri, "-D", ADMIN_DN, "-w", ADMIN_PASSWORD, *args],
            input=ldif.encode(),
            check=True,
            capture_output=True,
            timeout=30,
        )

    def add(self, ldif: str) -> None:
        self._tool("ldapadd", ldif)

    def modify(self, ldif: str) -> None:
        self._tool("ldapmodify", ldif)

    def delete(self, dn: str) -> None:
        self._tool("ldapdelete", "", dn)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)

    def settings(self) -> dict[str, str]:
        """The GPULAB_LDAP_* environment of a portal using this directory."""
        return {
            "GPULAB_LDAP_URI": self.uri,
            "GPULAB_LDAP_BIND_DN": SERVICE_DN,
            "GPULAB_LDAP_BIND_PASSWORD": SERVICE_PASSWORD,
            "GPULAB_LDAP_USER_SEARCH_BASE": PEOPLE,
            "GPULAB_LDAP_GROUP_SEARCH_BASE": GROUPS,
            "GPULAB_LDAP_TIMEOUT": "3",
        }


def start_slapd(root: Path) -> Slapd:
    """slapd on a free loopback port with the seeded university; raises if it
    does not answer within 30 s."""
    if not Path(SLAPD).exists():
        raise AssertionError(f"{SLAPD} is missing: apt-get install slapd ldap-utils")
    root.mkdir(parents=True, exist_ok=True)
    (root / "db").mkdir(exist_ok=True)
    schema = Path("/etc/ldap/schema")
    (root / "slapd.conf").write_text(
        "\n".join(
            [
                *(
                    f"include {schema / s}.schema"
                    for s in ("core", "cosine", "nis", "inetorgperson")
                ),
                f"pidfile {root / 'slapd.pid'}",
                "modulepath /usr/lib/ldap",
                "moduleload back_mdb",
                "database mdb",
                "maxsize 10485760",
                f'suffix "{SUFFIX}"',
                f'rootdn "{ADMIN_DN}"',
                f"rootpw {ADMIN_PASSWORD}",
                f"directory {root / 'db'}",
                # The service account and each user read everything; passwords
                # are only compared (bind), never read.
                "access to attrs=userPassword by anonymous auth by * none",
                "access to * by * read",
                "",
            ]
        )
    )
    port = free_port()
    uri = f"ldap://127.0.0.1:{port}"
    popen = subprocess.Popen(
        [SLAPD, "-f", str(root / "slapd.conf"), "-h", f"{uri}/", "-d", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    server = Slapd(uri, root, popen)

    def answers() -> bool:
        if popen.poll() is not None:
            raise AssertionError(
                f"slapd exited ({popen.returncode}): "
                + (popen.stderr.read().decode() if popen.stderr else "")
            )
        connection = ldap.initialize(uri)
        try:
            connection.simple_bind_s(ADMIN_DN, ADMIN_PASSWORD)
        except ldap.SERVER_DOWN:
            return False
        finally:
            connection.unbind_s()
        return True

    try:
        wait_until(answers, timeout=30, what=f"slapd on {uri}")
        server.add(SEED)
    except BaseException:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
        raise
    return server
