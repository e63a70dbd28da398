"""Selection: which entries each layer and KV head keeps, as a KeepSet."""

from sglang_kvx.select.keep_set import KeepSet, choose_keep_set, select_keep_set

__all__ = ["KeepSet", "choose_keep_set", "select_keep_set"]
