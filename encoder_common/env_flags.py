"""Command-line flags that also read environment variables, as pods are configured: every command
of the project (server, client, precompute) builds its parser from this."""

from __future__ import annotations

import argparse
import os


class EnvDefaultsParser(argparse.ArgumentParser):
    """An ArgumentParser whose options default to $<env_prefix><OPTION> when that is set."""

    def __init__(self, *args, env_prefix: str, **kwargs):
        self.env_prefix = env_prefix
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        long_name = next((n for n in names if n.startswith("--")), None)
        if long_name and kwargs.get("action") not in ("help", "version"):
            env = self.env_prefix + long_name[2:].upper().replace("-", "_")
            if env in os.environ:
                raw = os.environ[env]
                kwargs["required"] = False  # the environment gave it
                kwargs["default"] = (raw.lower() in ("1", "true", "yes")) if kwargs.get("action") == "store_true" else raw
            kwargs["help"] = f"{kwargs.get('help', '')} [env {env}; default: %(default)s]"
        return super().add_argument(*names, **kwargs)
