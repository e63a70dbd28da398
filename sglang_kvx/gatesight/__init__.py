"""GateSight's learned parts: estimator inputs (``features``), training target (``labels``) and
the per-(attention layer, KV head) MLPs with their model manifest (``estimator``).

The policy that serves them is ``sglang_kvx/policies/gatesight.py``; training is
``python -m sglang_kvx.training.train_gatesight``; scoring runs as one op in ``ops/gatesight.py``.
"""
