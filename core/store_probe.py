"""Is the tracking server there? Asked once, in a second or two, with nothing heavier
than urllib: `mopd` asks before it imports MLflow, torch or transformers (tens of seconds
on a busy machine), and MLflow's own client would retry a dead server for minutes."""
from __future__ import annotations

import os
import time
from pathlib import Path

import yaml

from core.config import ConfigError
from core.exitcodes import Unreachable


class StoreUnreachable(ConfigError, Unreachable):
    """The MLflow store cannot be opened (exit code 3: a tracking server that is down)."""


_REACHED: set[str] = set()   # servers that answered in this process


def probe_server(uri: str, timeout_s: float = 8.0) -> None:
    """Any HTTP answer (even 401 or 404, from an auth layer) but a gateway's 502-504 means
    the server at the http(s) `uri` is there; no connection, or none within `timeout_s`,
    is a StoreUnreachable naming the URI. Other URIs are not servers: nothing to ask."""
    import urllib.error
    import urllib.request

    if not uri.startswith(("http://", "https://")) or uri in _REACHED:
        return
    t0 = time.monotonic()
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError as e:
        if e.code not in (502, 503, 504):   # a gateway that cannot reach the server: as good as no answer
            _REACHED.add(uri)
            return
        why = f"HTTP {e.code} from a proxy or gateway in front of it"
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
    else:
        _REACHED.add(uri)
        return
    raise StoreUnreachable(
        f"the MLflow tracking server at {uri} does not answer ({why}; {time.monotonic() - t0:.1f}s): start it "
        f"(`mlflow server ...`, docs/experts.md) or point mlflow.tracking_uri / --tracking-uri / "
        f"$MLFLOW_TRACKING_URI at a running one")


def configured_uri(config: str | None = None, overrides: list[str] | None = None,
                   given: str | None = None) -> str | None:
    """The tracking URI a command will use, read without loading its config class:
    $MLFLOW_TRACKING_URI (it wins everywhere: core.tracking.resolve_uri), else `given`
    (a --tracking-uri flag), else a `mlflow.tracking_uri=` override, else the recipe's
    `mlflow.tracking_uri`. None when none is set (or the recipe cannot be read: the
    config loader reports that)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or given
    if uri:
        return uri
    for o in reversed(overrides or []):
        if o.startswith("mlflow.tracking_uri="):
            return o.split("=", 1)[1] or None
    try:
        doc = yaml.safe_load(Path(config).read_text()) if config else None
    except (OSError, yaml.YAMLError):
        return None
    section = doc.get("mlflow") if isinstance(doc, dict) else None
    value = section.get("tracking_uri") if isinstance(section, dict) else None
    return value if isinstance(value, str) and value else None
