"""Training for the embedded demo models (CPU, one thread).

``python -m sglang_kvx.training.train_demo --out weights/tiny-hybrid`` trains the
tiny hybrid to retrieve needles from long contexts; see ``train_demo`` for the recipe.
"""
