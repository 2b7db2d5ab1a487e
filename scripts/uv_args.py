"""Print, one per line, the uv arguments that make `uv pip install` read the same package sources as this machine's
pip (its configuration files and PIP_* variables): index URL, extra index URLs, find-links folders, constraint files,
and `--cert=PATH` for the certificate bundle (setup.sh hands that to uv as SSL_CERT_FILE). uv reads no pip
configuration of its own, so without these a machine whose pip finds the CPU torch in a local folder would make uv
resolve another torch. Run with the environment's Python (pip's own configuration reader)."""

from __future__ import annotations

from pip._internal.configuration import Configuration

LISTS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraint"}
SINGLE = {"index-url": "--index-url", "cert": "--cert"}


def uv_args() -> list[str]:
    config = Configuration(isolated=False)
    config.load()
    values: dict[str, str] = {}
    for key, value in config.items():  # files first, then the environment: later entries win, as in pip
        section, _, name = key.partition(".")
        if section in ("global", "install", ":env:"):
            values[name] = value
    out = []
    for name, flag in SINGLE.items():
        if values.get(name):
            out.append(f"{flag}={values[name]}")
    for name, flag in LISTS.items():
        out += [f"{flag}={v}" for v in values.get(name, "").split()]
    return out


if __name__ == "__main__":
    print("\n".join(uv_args()))
