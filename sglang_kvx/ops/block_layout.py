"""The block of block-sparse attention (shared by ``ops/block_sparse.py``'s references and kernels)."""

BLOCK = 4  # entries per block (the seed's four-token blocks)
