"""Audit the pinned requirements against known vulnerabilities with pip-audit (from PyPI), in a throwaway venv.

    python bench/audit_dependencies.py [--venv /tmp/grpo-panel-pip-audit] [--service pypi --service osv ...]

pip-audit is installed into its own venv under /tmp, never into the project's .venv. Each requirements file is
audited as pinned (`--no-deps --disable-pip`: nothing is resolved or installed, so this needs no package index;
requirements-dev.txt contributes its own pins, its `-r requirements.txt` being audited as that file), and so is
everything installed in the project's .venv when it exists (the full resolved tree CI runs, transitive dependencies
included). The vulnerability database itself cannot be carried offline: pip-audit asks a service
(PyPI's JSON API, OSV or ecosyste.ms) and caches its answers in --cache-dir.

A service that cannot be reached, or that answers "not found" for everything, would make an audit report "no known
vulnerabilities" about packages it never checked. So every service is first asked about a canary pin with published
advisories (requests 2.19.0: CVE-2018-18074); a service that does not flag it is not used, and if none does, the
script says so and exits 2.

Exit codes: 0 no known vulnerability in any audited pin; 1 vulnerabilities found (listed); 2 the audit could not run
here (the reason is printed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ("requirements.txt", "requirements-jobs.txt", "requirements-dev.txt")
PIP_AUDIT = "pip-audit==2.10.1"
SERVICES = ("pypi", "osv", "esms")
CANARY = "requests==2.19.0"  # published advisories: CVE-2018-18074 (PYSEC-2018-28), CVE-2023-32681, ...


class CannotAudit(RuntimeError):
    pass


def tool(folder: Path) -> Path:
    """pip-audit in its own venv at `folder`, installed from PyPI on first use."""
    executable = folder / "bin" / "pip-audit"
    if executable.exists():
        return executable
    venv.create(folder, with_pip=True, clear=True)
    done = subprocess.run(
        [str(folder / "bin" / "python"), "-m", "pip", "install", "--quiet", PIP_AUDIT],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not executable.exists():
        raise CannotAudit(f"could not install {PIP_AUDIT} into {folder}: {done.stderr.strip()[-1500:]}")
    return executable


def audit(executable: Path, service: str, cache: Path, sources: list[str]) -> dict:
    """pip-audit's JSON report for `sources` (its own arguments), or CannotAudit with pip-audit's last words."""
    command = [str(executable), *sources, "--vulnerability-service", service, "--format", "json"]
    command += ["--progress-spinner", "off", "--cache-dir", str(cache), "--timeout", "20"]
    done = subprocess.run(command, capture_output=True, text=True)
    try:  # exit 1 only means "vulnerabilities found": the report is still on stdout
        return json.loads(done.stdout)
    except ValueError:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        raise CannotAudit(f"pip-audit --vulnerability-service {service} failed: {last[0][:600]}") from None


def pinned(requirements: str) -> list[str]:
    return ["--requirement", str(ROOT / requirements), "--no-deps", "--disable-pip"]


def working_service(executable: Path, services: list[str], cache: Path, canary_file: Path) -> str:
    """The first service that flags the canary; CannotAudit listing why each one failed."""
    reasons = []
    for service in services:
        try:
            report = audit(
                executable, service, cache, ["--requirement", str(canary_file), "--no-deps", "--disable-pip"]
            )
        except CannotAudit as error:
            reasons.append(str(error))
            continue
        (entry,) = report["dependencies"]
        if entry.get("vulns"):
            return service
        reasons.append(
            f"{service}: did not flag {CANARY}, which has published advisories "
            f"({entry.get('skip_reason') or 'it reported no vulnerability'})"
        )
    raise CannotAudit("no vulnerability service answers from here:\n  - " + "\n  - ".join(reasons))


def findings(report: dict) -> tuple[list[str], list[str]]:
    """(one line per vulnerability, one line per dependency that could not be audited)."""
    found, skipped = [], []
    for dependency in report["dependencies"]:
        if dependency.get("skip_reason"):
            skipped.append(f"{dependency['name']}: {dependency['skip_reason']}")
        for vuln in dependency.get("vulns", []):
            fixes = ", ".join(vuln.get("fix_versions") or []) or "no fixed version yet"
            aliases = ", ".join(vuln.get("aliases") or [])
            found.append(
                f"{dependency['name']} {dependency.get('version', '')}: {vuln['id']}"
                + (f" ({aliases})" if aliases else "")
                + f"; fixed in {fixes}"
            )
    return found, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path("/tmp/grpo-panel-pip-audit"), help="pip-audit's own venv")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/grpo-panel-pip-audit-cache"))
    parser.add_argument("--service", action="append", choices=SERVICES, help="services to try, in order")
    args = parser.parse_args(argv)
    try:
        executable = tool(args.venv)
        canary = args.venv / "canary.txt"
        canary.write_text(CANARY + "\n")
        service = working_service(executable, args.service or list(SERVICES), args.cache_dir, canary)
        print(f"vulnerability service: {service} (it flags the canary {CANARY})")
        targets = [(name, pinned(name)) for name in REQUIREMENTS]
        site_packages = sorted((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
        if site_packages:
            targets.append((f"installed in .venv ({site_packages[0].parent.name})", ["--path", str(site_packages[0])]))
        vulnerable = False
        for name, sources in targets:
            found, skipped = findings(audit(executable, service, args.cache_dir, sources))
            vulnerable = vulnerable or bool(found)
            print(f"\n{name}: {len(found)} known vulnerabilities, {len(skipped)} not audited")
            for line in found + [f"not audited: {line}" for line in skipped]:
                print(f"  {line}")
    except CannotAudit as error:
        print(f"the dependency audit cannot run here: {error}", file=sys.stderr)
        return 2
    return 1 if vulnerable else 0


if __name__ == "__main__":
    sys.exit(main())
