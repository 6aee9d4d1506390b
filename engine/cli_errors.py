"""Turn Hydra's multi-line composition errors, and a side tool's bad arguments, into one
actionable line."""
from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose bad arguments are one line on stderr and exit code 2, as the
    main command's bad input is (its usage is --help's)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def condense_hydra_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
    blob = "\n".join(lines)

    m = re.search(r"Could not find '([\w/]+)/([^']+)'", blob)
    if m:
        group, option = m.groups()
        listing = f"; one of: {', '.join(options)}" if (options := _options(text)) else ""
        return f"unknown {group} '{option}'{listing}"

    m = re.search(r"You must specify '([\w/]+)'", blob)
    if m:
        group = m.group(1)
        listing = f", one of: {', '.join(options)}" if (options := _options(text)) else ""
        return f"no {group} given; add {group}=NAME{listing}"

    m = re.search(r"Could not override '([^']+)'", blob)
    if m and ("not in struct" in blob or "not in 'Config'" in blob):
        key = m.group(1)
        return (f"unknown key '{key}': it is not in the config schema; check the spelling "
                f"(python -m engine model=tiny --cfg job shows every key)")

    m = re.search(r"Key '([^']+)' not in '(\w+)'", blob) or re.search(
        r"Key '([^']+)' is not in struct", blob)
    if m:
        full = re.search(r"full_key: (\S+)", blob)
        key = full.group(1) if full else m.group(1)
        return (f"unknown key '{key}': it is not in the config schema; check the spelling "
                f"(python -m engine model=tiny --cfg job shows every key)")

    m = re.search(r"Value '([^']*)' (?:of type '\w+' )?could not be converted to (\w+)", blob)
    if m:
        full = re.search(r"full_key: (\S+)", blob)
        key = full.group(1) if full else "a value"
        return f"{key}={m.group(1)!r} is not a valid {m.group(2)}; give a {m.group(2).lower()}"

    m = re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", blob)
    if m:
        full = re.search(r"full_key: (\S+)", blob)
        key = full.group(1) if full else "a value"
        return f"{key}={m.group(1)!r} is not one of {m.group(2)}"

    m = re.search(r"Multiple values for (\S+)\. To override a value use '([^']+)'", blob)
    if m:
        return f"{m.group(1)} is given twice; use {m.group(2)} to override it"

    return "; ".join(lines) if lines else "Hydra could not compose the config"


def _options(text: str) -> list[str]:
    """The options Hydra lists after "Available options", one a line."""
    if "Available options" not in text:
        return []
    listing = text.split("Available options", 1)[1].partition("\n")[2]  # past "...options in 'x':"
    return re.findall(r"^\t?(\S+)$", listing, re.M)
