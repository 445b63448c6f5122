#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Check Kubernetes manifests offline: against the Kubernetes API schema,
and against the rules bufbroker's examples promise.

Usage: scripts/check-manifests.py FILE.yaml...

The schema is the one Debian's python3-kubernetes carries (its models are
generated from the API's OpenAPI document): every object of every document
must be a known kind, every field a field of its type (an unknown field,
e.g. a misspelt securityContext, is an error, as kubectl's strict field
validation makes it), every value of its type, every required field
present and every enum value allowed. Quantities (resources) may be
numbers, as the API accepts them.

The rules, for every pod spec (a Pod, a workload's template): no host IPC,
PID or network namespace; no privileged container and no privilege
escalation; every container drops ALL capabilities and adds none (an init
container may add CHOWN alone); every container that is not an init
container runs as non-root; the pod uses the runtime's default seccomp
profile; the only hostPath is /run/bufbroker, the socket directory.

Exits 0 when every file passes, 1 (naming each problem) when not.
"""
import re
import sys

import kubernetes
import yaml
from kubernetes import client

QUANTITY_TYPES = {"V1ResourceRequirements"}


class Checker:
    def __init__(self):
        self.problems = []

    def problem(self, where, msg):
        self.problems.append(f"{where}: {msg}")

    def value(self, v, t, where, owner=None):
        """Check v against the type t of the OpenAPI model (a string)."""
        if t == "object":
            return
        m = re.fullmatch(r"list\[(.+)\]", t)
        if m:
            if not isinstance(v, list):
                return self.problem(where, f"want a list, not {type(v).__name__}")
            for i, x in enumerate(v):
                self.value(x, m.group(1), f"{where}[{i}]", owner)
            return
        m = re.fullmatch(r"dict\(str, (.+)\)", t)
        if m:
            if not isinstance(v, dict):
                return self.problem(where, f"want a map, not {type(v).__name__}")
            for k, x in v.items():
                if not isinstance(k, str):
                    self.problem(where, f"key {k!r} is not a string")
                self.value(x, m.group(1), f"{where}.{k}", owner)
            return
        if t == "str":
            if isinstance(v, str):
                return
            # A quantity may be written as a number.
            if owner in QUANTITY_TYPES and isinstance(v, (int, float)) and not isinstance(v, bool):
                return
            return self.problem(where, f"want a string, not {type(v).__name__} {v!r}")
        if t == "int":
            if not isinstance(v, int) or isinstance(v, bool):
                self.problem(where, f"want an integer, not {v!r}")
            return
        if t == "float":
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                self.problem(where, f"want a number, not {v!r}")
            return
        if t == "bool":
            if not isinstance(v, bool):
                self.problem(where, f"want true or false, not {v!r}")
            return
        if t == "datetime":
            if not isinstance(v, str):
                self.problem(where, f"want a time, not {v!r}")
            return
        cls = getattr(client, t, None)
        if cls is None or not hasattr(cls, "openapi_types"):
            return self.problem(where, f"no model {t} in python3-kubernetes")
        self.model(v, cls, where)

    def model(self, v, cls, where):
        if not isinstance(v, dict):
            return self.problem(where, f"want an object ({cls.__name__}), not {v!r}")
        by_json = {j: p for p, j in cls.attribute_map.items()}
        kwargs = {}
        for k, x in v.items():
            if k not in by_json:
                self.problem(f"{where}.{k}", f"unknown field of {cls.__name__}")
                continue
            p = by_json[k]
            self.value(x, cls.openapi_types[p], f"{where}.{k}", cls.__name__)
            kwargs[p] = x
        # The model's constructor checks required fields and enum values.
        try:
            cls(**kwargs)
        except (ValueError, TypeError) as e:
            self.problem(where, f"{cls.__name__}: {e}")

    def document(self, doc, where):
        if not isinstance(doc, dict):
            return self.problem(where, "not an object")
        api, kind = doc.get("apiVersion"), doc.get("kind")
        if not isinstance(api, str) or not isinstance(kind, str):
            return self.problem(where, "no apiVersion and kind")
        version = api.split("/")[-1]
        cls = getattr(client, version[:1].upper() + version[1:] + kind, None)
        if cls is None or not hasattr(cls, "openapi_types"):
            return self.problem(where, f"unknown kind {api} {kind}")
        self.model(doc, cls, where)
        spec = doc.get("spec") or {}
        if kind == "Pod":
            self.pod(spec, f"{where}.spec")
        elif isinstance(spec.get("template"), dict):
            self.pod(spec["template"].get("spec") or {}, f"{where}.spec.template.spec")

    def pod(self, spec, where):
        for f in ("hostIPC", "hostPID", "hostNetwork"):
            if spec.get(f):
                self.problem(f"{where}.{f}", "the pod must not share the node's namespaces")
        psc = spec.get("securityContext") or {}
        seccomp = (psc.get("seccompProfile") or {}).get("type")
        if seccomp != "RuntimeDefault":
            self.problem(f"{where}.securityContext.seccompProfile", "want type RuntimeDefault")
        for i, vol in enumerate(spec.get("volumes") or []):
            hp = vol.get("hostPath")
            if hp and hp.get("path") != "/run/bufbroker":
                self.problem(f"{where}.volumes[{i}]", f"hostPath {hp.get('path')}: only /run/bufbroker")
        for group in ("initContainers", "containers"):
            for i, c in enumerate(spec.get(group) or []):
                self.container(c, psc, group == "initContainers", f"{where}.{group}[{i}]")

    def container(self, c, psc, init, where):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            self.problem(f"{where}.securityContext.privileged", "no privileged containers")
        if sc.get("allowPrivilegeEscalation") is not False:
            self.problem(f"{where}.securityContext", "want allowPrivilegeEscalation: false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            self.problem(f"{where}.securityContext.capabilities", "want drop: [ALL]")
        add = caps.get("add") or []
        if add and not (init and add == ["CHOWN"]):
            self.problem(f"{where}.securityContext.capabilities.add",
                         f"{add}: none (an init container: CHOWN alone)")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if not init and non_root is not True:
            self.problem(f"{where}", "want runAsNonRoot: true")


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    chk = Checker()
    for path in argv[1:]:
        try:
            with open(path) as f:
                docs = list(yaml.safe_load_all(f))
        except (OSError, yaml.YAMLError) as e:
            chk.problem(path, str(e))
            continue
        docs = [d for d in docs if d is not None]
        if not docs:
            chk.problem(path, "no documents")
        for n, doc in enumerate(docs, 1):
            name = (doc.get("metadata") or {}).get("name") if isinstance(doc, dict) else None
            kind = doc.get("kind") if isinstance(doc, dict) else None
            chk.document(doc, f"{path}: document {n} ({kind} {name})")
    for p in chk.problems:
        print(p, file=sys.stderr)
    if chk.problems:
        print(f"check-manifests: {len(chk.problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"check-manifests: {len(argv) - 1} file(s) valid for the Kubernetes API "
          f"(python3-kubernetes {kubernetes.__version__}) and bufbroker's pod rules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
