"""``none``: keep every entry. SGLang serves exactly as it does without the extension."""

from sglang_kvx.policies.base import KVPolicy, register_policy


@register_policy("none")
class NoCompaction(KVPolicy):
    compacts = False
