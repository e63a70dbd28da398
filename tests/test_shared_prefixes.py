"""Auto-contexts (``serve/shared_prefixes.py``) as admission asks them, without a server: which plain
request queues a parent of the server's own, which requests wait for it, and that namespaces (SGLang's
``cache_salt`` / ``extra_key``) never meet. The served behaviour is in test_frontend_and_openai.py."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from sglang_kvx.serve.shared_prefixes import AutoContexts
from sglang_kvx.settings import NO_FIELDS, RequestFields, ServerDefaults, resolve_settings

DEFAULTS = ServerDefaults("knorm", 0.5, 0, frozenset({"keys"}))  # a model whose keys KNorm reads
DOCUMENT = list(range(100, 200))


def plain(ids, namespace=None, fields=NO_FIELDS):
    request = SimpleNamespace(input_ids=ids, namespace=namespace, rid="client", finished=False)
    return request, SimpleNamespace(prefix_checked=False, parent=False, internal=False, fields=fields)


def auto(min_tokens: int = 64):
    submitted = []
    contexts = AutoContexts(min_tokens, lambda *args: submitted.append(args),
                            functools.partial(resolve_settings, NO_FIELDS, DEFAULTS), compacts=True)
    return contexts, submitted


def test_the_request_that_shows_a_repeat_and_the_ones_after_it_wait_for_one_parent():
    contexts, submitted = auto()
    assert not contexts.waits(*plain(DOCUMENT + [1, 2]))  # nothing repeated yet: served plain
    assert contexts.waits(*plain(DOCUMENT + [3, 4]))  # repeats 100 tokens: the parent is queued, it waits
    [(rid, ids, compact, namespace)] = submitted
    assert ids == DOCUMENT and compact is True and namespace is None and contexts.is_own(rid)
    assert contexts.waits(*plain(DOCUMENT + [5]))  # arrives while the parent is made: waits, queues nothing
    assert len(submitted) == 1
    request, state = plain(DOCUMENT + [6])
    state.prefix_checked = True  # seen before: asked once only
    assert not contexts.waits(request, state)
    assert contexts.pending_for(DOCUMENT + [7], resolve_settings(NO_FIELDS, DEFAULTS))
    assert not contexts.pending_for(DOCUMENT, None)  # only prompts strictly extending it
    assert not contexts.pending_for(DOCUMENT[:50] + [7], None)
    parent = SimpleNamespace(input_ids=DOCUMENT, namespace=None, rid=rid, finished=True)
    contexts.released(parent)
    assert not contexts.pending_for(DOCUMENT + [7], None)


def test_namespaces_and_marked_requests_never_wait_for_anothers_parent():
    contexts, submitted = auto()
    salted = ("tenantA", None), (None, "tenantA")
    for namespace in salted:
        assert not contexts.waits(*plain(DOCUMENT + [1], namespace))
    assert contexts.waits(*plain(DOCUMENT + [2], salted[0]))  # tenantA's own repeat
    assert not contexts.waits(*plain(DOCUMENT + [3]))  # unsalted: the first of its namespace
    assert contexts.waits(*plain(DOCUMENT + [4], salted[1]))  # the other namespace's repeat: a parent of its own
    assert [args[3] for args in submitted] == [salted[0], salted[1]]
    assert contexts.pending_for(DOCUMENT + [9], resolve_settings(NO_FIELDS, DEFAULTS, salted[0]))
    assert not contexts.pending_for(DOCUMENT + [9], resolve_settings(NO_FIELDS, DEFAULTS))  # unsalted reads neither
    other_fraction = resolve_settings(RequestFields(keep_fraction=0.25), DEFAULTS, salted[0])
    assert not contexts.pending_for(DOCUMENT + [9], other_fraction)  # the parent is made with the server's settings
    assert not contexts.waits(*plain(DOCUMENT + [5], salted[0], fields=RequestFields(keep_fraction=0.25)))
