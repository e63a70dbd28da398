"""What a benchmark run with ``--url`` reports about a server it did not start: read from that server.

A benchmark that starts its own server reports the flags it gave it. With ``--url``
(``sglang_kvx.serve.launcher.add_url_option``) the running server's own flags stand, so every
figure a script would have taken from its flags is read from the server instead: the pool, the
default policy, keep fraction and every other ``--kvx-*`` setting (decode steps, a default decode
step, block-sparse attention, the recall head) from ``/kvx/stats``; the model and the
chunked-prefill size from SGLang's ``/server_info`` (its resolved settings), the context length
from ``/v1/models``. A server that cannot
run the measurement as asked is refused with a message naming what it lacks (``Mismatch``, exit 1),
never measured and mislabelled.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import requests

# Launch flags that name where a server runs, not how it serves: left out of ``Served.flags``.
WHERE = ("--model-path", "--host", "--port")


class Mismatch(SystemExit):
    """The server at ``--url`` cannot run this benchmark's measurement as asked."""


def _get(url: str, route: str) -> Any:
    try:
        response = requests.get(url + route, timeout=60)
    except requests.RequestException as exc:
        raise Mismatch(f"--url {url}: GET {route} failed: {exc}") from None
    if response.status_code != 200:
        raise Mismatch(f"--url {url}: GET {route} answered {response.status_code}: {response.text[:300]}")
    return response.json()


@dataclass(frozen=True)
class Served:
    """One running server's settings, as it reports them."""

    url: str
    model_path: str
    context_length: int  # the longest request (prompt + output) it accepts
    chunked_prefill_size: int  # tokens per prefill chunk; <= 0: every prompt in one chunk
    pool_tokens: int  # KV pool slots (``kv_pool_total_tokens``)
    policy: str  # --kvx-policy: compaction of requests that do not name their own
    keep_fraction: float  # --kvx-keep-fraction
    settings: dict[str, Any]  # every --kvx-* setting, as /kvx/stats reports the server's config
    launch_command: str | None  # the arguments it was launched with (SGLang's ``launch_command``)

    def refuse(self, why: str) -> NoReturn:
        raise Mismatch(f"--url {self.url}: {why}")

    @property
    def decode_steps(self) -> bool:
        """Whether requests may ask for decode-time steps (``--kvx-decode-steps on``, implied by ``--kvx-decode``)."""
        return bool(self.settings["decode_steps"])

    @property
    def default_decode(self) -> dict | None:
        """``--kvx-decode``: the step every request runs unless it names its own, as its JSON object (None: none)."""
        return self.settings["decode"] or None

    @property
    def sparse_budget(self) -> int:
        """``--kvx-sparse-attention``: tokens each query attends to (0: dense attention)."""
        return int(self.settings["sparse_budget"])

    @property
    def oda_head(self) -> str:
        """The recall head folder it serves ("" when none): its --kvx-oda-head, else the one found for its model."""
        from sglang_kvx.decode.oda import find_head

        try:
            return find_head(self.model_path, str(self.settings["oda_head"]))
        except ValueError:
            return ""

    @property
    def flags(self) -> str:
        """Its launch flags, less where it runs (model path, host, port)."""
        tokens = (self.launch_command or "").split()
        kept, skip = [], False
        for token in tokens:
            if skip:
                skip = False
            elif token in WHERE:
                skip = True
            elif not token.startswith(tuple(w + "=" for w in WHERE)):
                kept.append(token)
        return " ".join(kept)

    def require_model(self, path: str | Path) -> None:
        if Path(self.model_path).resolve() != Path(path).resolve():
            self.refuse(f"it serves {self.model_path}, not {path} (name its model with the script's model option)")

    def require_context(self, tokens: int, why: str) -> None:
        if self.context_length < tokens:
            self.refuse(f"its context length is {self.context_length} tokens; {why} needs {tokens}")

    def require_pool(self, tokens: int, why: str) -> None:
        if self.pool_tokens < tokens:
            self.refuse(f"its KV pool holds {self.pool_tokens} tokens; {why} needs {tokens}")

    def require_plain_decoding(self) -> None:
        """Decode-time steps on for the requests that ask, and none for the ones that do not (a plain arm)."""
        if not self.decode_steps:
            self.refuse("it was not started with --kvx-decode-steps on: requests cannot ask for decode-time steps")
        if self.default_decode:
            self.refuse("it runs a default decode step (--kvx-decode) on every request: its plain arm would not be plain")

    def summary(self) -> dict[str, Any]:
        """What a result records about the server an arm ran on."""
        return {"url": self.url, "model": Path(self.model_path).name, "policy": self.policy,
                "keep_fraction": self.keep_fraction, "pool_tokens": self.pool_tokens, "flags": self.flags}


def describe(url: str) -> Served:
    """The settings of the server at ``url``, from its own routes."""
    url = url.rstrip("/")
    info = _get(url, "/server_info")
    stats = _get(url, "/kvx/stats")
    models = _get(url, "/v1/models")["data"]
    return Served(
        url=url,
        model_path=str(info["model_path"]),
        context_length=int(models[0]["max_model_len"]),
        chunked_prefill_size=int(info.get("chunked_prefill_size") or -1),
        pool_tokens=int(stats["kv_pool_total_tokens"]),
        policy=str(stats["policy"]),
        keep_fraction=float(stats["keep_fraction"]),
        settings=stats["settings"],
        launch_command=info.get("launch_command"),
    )


def agree(parser: argparse.ArgumentParser, args: argparse.Namespace, dest: str, served: Any, url: str) -> Any:
    """``served``, the server's own value of a setting the option ``dest`` gives a server the script
    starts; an option set away from its default to another value than the server's is the parser's
    error (it would not be what was measured)."""
    given = getattr(args, dest)
    if given != parser.get_default(dest) and given != served:
        flag = "--" + dest.replace("_", "-")
        parser.error(f"{flag} {given} sets the server this script would start; the server at {url} has {served} "
                     f"(drop {flag} to use it, or drop --url)")
    return served
