"""The adapter for SGLang: the only package of sglang_kvx that imports SGLang or names its fields.

  entry.py            the ``sglang.srt.platforms`` entry point (no SGLang import: it runs while SGLang resolves its platform)
  plugin.py           the ``sglang.srt.plugins`` entry point: flags, validation, registries, routes
  contract.py         every hook target and SGLang attribute used, checked against the installed SGLang
  door.py             request validation in the HTTP process, before the scheduler
  scheduler_hooks.py  the hooks in scheduler processes, handing views to ``serve.runtime.Runtime``
  views.py            ``ports`` views of SGLang's pools, requests and forward batches
  forward.py          how forward-time code finds its runtime (on the forward batch)
  attention.py        per-layer lengths of compacted prefixes for any full-attention backend
  gdn_backend.py, cpu_standins.py, platform.py   the pure-torch CPU platform and GDN backend
  model.py            layer ids and RoPE frequencies from the model's config
  internal_requests.py, engine.py, stats.py
Importing this package imports nothing from SGLang.
"""

# SGLang's own launcher, which the CLI and the test harness run as ``python -m``.
LAUNCH_MODULE = "sglang" + ".launch_server"
