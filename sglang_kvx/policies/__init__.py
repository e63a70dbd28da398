"""KV policies: each decides which attention KV entries a compacted context keeps.

A policy joins the registry with one line, ``@register_policy("name")`` on its
class; the ``--kvx-policy`` flag accepts exactly the names registered here.
"""

from sglang_kvx.policies.base import (
    POLICIES,
    KVPolicy,
    ModelTraits,
    get_policy,
    policy_names,
    register_policy,
    servable_policy_names,
)

# Importing a policy module registers it.
from sglang_kvx.policies import none  # noqa: F401,E402
from sglang_kvx.policies import h2o, keydiff, knorm, pyramidkv, random, snapkv, streamingllm  # noqa: F401,E402
from sglang_kvx.policies import kvzip, triattention  # noqa: F401,E402
from sglang_kvx.policies import gatesight  # noqa: F401,E402
from sglang_kvx.policies import kvzap  # noqa: F401,E402

__all__ = ["POLICIES", "KVPolicy", "ModelTraits", "get_policy", "policy_names", "register_policy", "servable_policy_names"]
